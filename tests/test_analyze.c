/* SPDX-License-Identifier: Apache-2.0 */
/* Routing analysis (src/analyze/analyze.h): record sets built here with jansson, each with answers known in
 * advance: every metric of a hand-built set (reuse, owner vs chosen and its cost, stale and approx
 * predictions, outcome kinds with HTTP 200 streams that did not finish, TTFT, recovery windows),
 * joins by (instance, decision_id) and by (request_id, attempt_id), unjoined records on both sides,
 * duplicates, invalid lines of every kind with FILE:LINE, nulls against zeros, rotated files given
 * in any order, router overrides (dispatched_worker) compared with the dispatched worker's depth or
 * counted as unpredicted, worker health (the owner != chosen split by the owner's eligibility,
 * ineligible candidates per worker, records without the field), and a random property test against
 * a brute-force model of every metric (overrides and worker health included), and one of the join
 * (retries, outcomes of other instances, duplicate lines, warm-ups) against a brute-force reader.
 * Control characters in record strings reach neither report raw. The HTML
 * report is checked for escaping and self-containment, its SVG parts parsed as XML by
 * tests/check_html.py, and rendered in headless Chromium when one is installed. Randomized tests
 * print their seed (KM_TEST_SEED). */
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "analyze/analyze.h"
#include "base/utf8.h"
#include "test_util.h"

#define BLOCK 16

/* ---- building records ------------------------------------------------------------------------ */

/* A candidate's `eligible` field: absent (records written before worker health), true, false. */
enum { ELIGIBLE_ABSENT = 0, ELIGIBLE_TRUE, ELIGIBLE_FALSE };

typedef struct cand_spec {
    const char *worker, *state;
    int64_t depth_blocks;
    int64_t in_flight; /* -1 = null */
} cand_spec;

typedef struct decision_spec {
    const char *instance;
    int64_t id;
    const char *request, *attempt;
    const char *host; /* NULL = null */
    const char *pool;
    int64_t time_ns;
    const char *source; /* "events" / "approx" */
    int64_t prompt;     /* -1 = null */
    const char *owner, *owner_state;
    int64_t owner_blocks;
    const char *chosen, *chosen_state;
    int64_t chosen_blocks;
    const char *policy;
    cand_spec cands[8];
    int eligible[8]; /* ELIGIBLE_* of each cands[] row; ELIGIBLE_FALSE writes cost null, as the
                      * server does */
    int unweighed[8]; /* an eligible row written with cost null (the policy left it out) */
    int n_cands;
    const char *reason; /* decision.reason; NULL = "min_cost" */
    int null_reason;    /* decision.reason null instead */
    int warm_up;        /* a warm-up: decision.warm_up_for is warm_up_for (else absent) */
    int64_t warm_up_for;
} decision_spec;

typedef struct outcome_spec {
    const char *instance;
    int64_t id;
    const char *request, *attempt;
    const char *host, *pool;
    int64_t time_ns;
    const char *outcome;
    int64_t http_status, cached, prompt, decided_ns, ttft_ns; /* -1 = null */
    const char *worker;
    const char *dispatched; /* dispatched_worker; NULL = null */
    int64_t predicted_blocks;
    const char *owner;
    int64_t owner_blocks;
} outcome_spec;

static json_t *nullable_int(int64_t v)
{
    return v < 0 ? json_null() : json_integer(v);
}

static json_t *nullable_str(const char *s)
{
    return s ? json_string(s) : json_null();
}

static void common_fields(json_t *o, const char *type, const char *instance, int64_t id,
                          const char *request, const char *attempt, const char *host,
                          const char *pool, int64_t time_ns)
{
    json_object_set_new(o, "type", json_string(type));
    json_object_set_new(o, "schema_version", json_integer(1));
    json_object_set_new(o, "record_id", json_integer(id * 2 + (type[0] == 'o')));
    json_object_set_new(o, "instance", json_string(instance));
    json_object_set_new(o, "host", nullable_str(host));
    json_object_set_new(o, "kvmatch_version", json_string("0.1.0"));
    json_object_set_new(o, "decision_id", json_integer(id));
    json_object_set_new(o, "request_id", json_string(request));
    json_object_set_new(o, "attempt_id", json_string(attempt));
    json_object_set_new(o, "model", json_string("m"));
    json_object_set_new(o, "pool", json_string(pool));
    json_object_set_new(o, "endpoint", json_string("/v1/completions"));
    json_object_set_new(o, "time", json_string("2026-11-30T05:56:54.079639Z"));
    json_object_set_new(o, "monotonic_ns", json_integer(time_ns));
}

static json_t *worker_depth(const char *worker, const char *state, int64_t blocks)
{
    return json_pack("{so so sI sI}", "worker", nullable_str(worker), "state",
                     nullable_str(worker ? state : NULL), "depth_blocks",
                     (json_int_t)(worker ? blocks : 0), "depth_tokens",
                     (json_int_t)(worker ? blocks * BLOCK : 0));
}

static json_t *make_decision(const decision_spec *d)
{
    json_t *o = json_object();
    common_fields(o, "decision", d->instance, d->id, d->request, d->attempt, d->host, d->pool,
                  d->time_ns);
    json_object_set_new(o, "prediction",
                        json_pack("{ss ss ss si sI so so so so}", "source", d->source, "input",
                                  "tokens", "units", "blocks", "block_size", BLOCK, "block_count",
                                  (json_int_t)64, "prompt_tokens", nullable_int(d->prompt),
                                  "expected_output_tokens", json_null(), "scored_monotonic_ns",
                                  json_null(), "owner",
                                  worker_depth(d->owner, d->owner_state, d->owner_blocks)));
    json_object_set_new(
        o, "decision",
        json_pack("{ss so so sb s{ss sf ss}}", "policy", d->policy, "reason",
                  d->null_reason ? json_null() : json_string(d->reason ? d->reason : "min_cost"),
                  "chosen",
                  worker_depth(d->chosen, d->chosen_state, d->chosen_blocks), "owner_is_chosen",
                  d->owner && !strcmp(d->owner, d->chosen), "load", "kind", "in_flight", "value",
                  1.0, "scope", "this_instance"));
    if (d->warm_up)
        json_object_set_new(json_object_get(o, "decision"), "warm_up_for",
                            json_integer(d->warm_up_for));
    json_t *cands = json_array();
    for (int i = 0; i < d->n_cands; i++) {
        const cand_spec *c = &d->cands[i];
        json_t *row = json_pack("{ss ss sI sI sI sn sn so sn sn}", "worker", c->worker, "state",
                                c->state, "depth_blocks", (json_int_t)c->depth_blocks,
                                "depth_tokens", (json_int_t)(c->depth_blocks * BLOCK),
                                "device_blocks", (json_int_t)c->depth_blocks, "host_blocks",
                                "disk_blocks", "in_flight", nullable_int(c->in_flight),
                                "pending_prefill_tokens", "active_decode_blocks");
        if (d->eligible[i] != ELIGIBLE_ABSENT)
            json_object_set_new(row, "eligible", json_boolean(d->eligible[i] == ELIGIBLE_TRUE));
        json_object_set_new(row, "cost", d->eligible[i] == ELIGIBLE_FALSE || d->unweighed[i]
                                             ? json_null()
                                             : json_real(0.5));
        json_array_append_new(cands, row);
    }
    json_object_set_new(o, "candidates", cands);
    return o;
}

static json_t *make_outcome(const outcome_spec *s)
{
    json_t *o = json_object();
    common_fields(o, "outcome", s->instance, s->id, s->request, s->attempt, s->host, s->pool,
                  s->time_ns);
    json_object_set_new(o, "outcome", json_string(s->outcome));
    json_object_set_new(o, "finish_reason", json_null());
    json_object_set_new(o, "done_seen", json_null());
    json_object_set_new(o, "http_status", nullable_int(s->http_status));
    json_object_set_new(o, "error", json_null());
    json_object_set_new(o, "worker", json_string(s->worker));
    json_object_set_new(o, "dispatched_worker", nullable_str(s->dispatched));
    json_object_set_new(o, "cached_tokens", nullable_int(s->cached));
    json_object_set_new(o, "prompt_tokens", nullable_int(s->prompt));
    json_object_set_new(o, "output_tokens", json_null());
    json_object_set_new(o, "retries", json_integer(0));
    json_object_set_new(o, "decided_time", json_null());
    json_object_set_new(o, "decided_monotonic_ns", nullable_int(s->decided_ns));
    const char *lifecycle[] = {"dispatched", "first_token", "finished"};
    for (int i = 0; i < 3; i++) {
        char key[64];
        snprintf(key, sizeof key, "%s_time", lifecycle[i]);
        json_object_set_new(o, key, json_null());
        snprintf(key, sizeof key, "%s_monotonic_ns", lifecycle[i]);
        json_object_set_new(o, key, json_null());
    }
    json_object_set_new(o, "wait_ns", json_null());
    json_object_set_new(o, "ttft_ns", nullable_int(s->ttft_ns));
    json_object_set_new(o, "predicted",
                        json_pack("{ss ss si sI sI so sI sI}", "source", "events", "units",
                                  "blocks", "block_size", BLOCK, "depth_blocks",
                                  (json_int_t)s->predicted_blocks, "depth_tokens",
                                  (json_int_t)(s->predicted_blocks * BLOCK), "owner_worker",
                                  nullable_str(s->owner), "owner_depth_blocks",
                                  (json_int_t)s->owner_blocks, "owner_depth_tokens",
                                  (json_int_t)(s->owner_blocks * BLOCK)));
    return o;
}

static void write_record(FILE *f, json_t *record)
{
    cr_assert(record, "record build failed (json_pack)");
    char *line = json_dumps(record, JSON_COMPACT | JSON_PRESERVE_ORDER);
    cr_assert(line);
    fprintf(f, "%s\n", line);
    free(line);
    json_decref(record);
}

/* The outcome that goes with a decision (same keys, worker, prediction copy). */
static outcome_spec outcome_for(const decision_spec *d, const char *kind, int64_t http_status,
                                int64_t cached, int64_t ttft_ns)
{
    return (outcome_spec){.instance = d->instance, .id = d->id, .request = d->request,
                          .attempt = d->attempt, .host = d->host, .pool = d->pool,
                          .time_ns = d->time_ns + 500, .outcome = kind, .http_status = http_status,
                          .cached = cached, .prompt = d->prompt, .decided_ns = d->time_ns,
                          .ttft_ns = ttft_ns, .worker = d->chosen,
                          .predicted_blocks = d->chosen_blocks, .owner = d->owner,
                          .owner_blocks = d->owner ? d->owner_blocks : 0};
}

static void write_outcome_of(FILE *f, const decision_spec *d, const char *kind,
                             int64_t http_status, int64_t cached, int64_t ttft_ns)
{
    outcome_spec o = outcome_for(d, kind, http_status, cached, ttft_ns);
    write_record(f, make_outcome(&o));
}

static void make_temp_dir(char dir[64])
{
    snprintf(dir, 64, "/tmp/km-analyze-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
}

static void remove_dir(const char *dir)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    int rc = system(cmd);
    (void)rc;
}

static FILE *open_in(const char *dir, const char *name, char *path, size_t path_size)
{
    snprintf(path, path_size, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f, "fopen %s: %s", path, strerror(errno));
    return f;
}

static km_analysis *analyze_files(const km_analysis_config *cfg, const char *const *paths, size_t n)
{
    km_analysis *a = NULL;
    cr_assert_eq(km_analysis_create(cfg, &a), KM_OK);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(km_analysis_add_file(a, paths[i]), KM_OK, "%s: %s", paths[i],
                     km_analysis_last_error(a));
    cr_assert_eq(km_analysis_finish(a), KM_OK, "%s", km_analysis_last_error(a));
    return a;
}

/* Occurrences of needle in haystack. */
static int count_of(const char *haystack, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(haystack, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* The JSON report of a finished analysis, parsed. */
static json_t *json_report(const km_analysis *a)
{
    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_json(a, &text), KM_OK);
    json_error_t error;
    json_t *root = json_loads(km_text_cstr(&text), 0, &error);
    cr_assert(root, "JSON report does not parse: %s", error.text);
    km_text_free(&text);
    return root;
}

/* root[section][key] as an integer; fails when the key is absent (every key is always present). */
static int64_t json_count(json_t *root, const char *section, const char *key)
{
    json_t *v = json_object_get(section ? json_object_get(root, section) : root, key);
    cr_assert(json_is_integer(v), "%s.%s missing or not an integer", section ? section : "", key);
    return (int64_t)json_integer_value(v);
}

/* ---- the hand-built set ------------------------------------------------------------------------ */

#define SEC 1000000000LL

/* Writes the known-answer set into dir/records.jsonl (worker B's name is `b`, which lets the HTML
 * test use a name full of markup). */
static void write_known_set(const char *path, const char *b)
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    /* D1: owner A (12 blocks) not chosen; B (0) chosen: owner and chosen kept apart. */
    decision_spec d1 = {.instance = "i1", .id = 1, .request = "r1", .attempt = "0", .host = "h1",
                        .pool = "p", .time_ns = 1 * SEC, .source = "events", .prompt = 650,
                        .owner = "A", .owner_state = "LIVE", .owner_blocks = 12, .chosen = b,
                        .chosen_state = "LIVE", .chosen_blocks = 0, .policy = "cache_aware",
                        .cands = {{"A", "LIVE", 12, 9}, {b, "LIVE", 0, 1}}, .n_cands = 2};
    decision_spec d2 = d1, d3 = d1, d4 = d1, d5 = d1, d7 = d1, d9 = d1;
    d2.id = 2, d2.request = "r2", d2.time_ns = 2 * SEC, d2.owner_blocks = 10, d2.chosen = "A",
    d2.chosen_blocks = 10, d2.prompt = 200;
    d2.cands[0] = (cand_spec){"A", "LIVE", 10, 3};
    d3.id = 3, d3.request = "r3", d3.time_ns = 3 * SEC, d3.owner_blocks = 5, d3.chosen = "A",
    d3.chosen_blocks = 5, d3.prompt = 100;
    d3.cands[0] = (cand_spec){"A", "LIVE", 5, 5};
    d4.id = 4, d4.request = "r4", d4.time_ns = 4 * SEC, d4.owner = NULL, d4.chosen_blocks = 0,
    d4.prompt = -1;
    d4.cands[0] = (cand_spec){"A", "LIVE", 0, 2};
    d5.id = 5, d5.request = "r5", d5.time_ns = 5 * SEC, d5.owner_blocks = 4, d5.chosen = "A",
    d5.chosen_blocks = 4;
    /* D6: an approximate pool. */
    decision_spec d6 = {.instance = "i1", .id = 6, .request = "r6", .attempt = "0", .host = "h1",
                        .pool = "approxpool", .time_ns = 6 * SEC, .source = "approx", .prompt = 64,
                        .owner = "C", .owner_state = "APPROX", .owner_blocks = 2, .chosen = "C",
                        .chosen_state = "APPROX", .chosen_blocks = 2, .policy = "round_robin",
                        .cands = {{"C", "APPROX", 2, -1}}, .n_cands = 1};
    /* D7: A is SYNCING (and owns 3 blocks), B in GAP chosen with 1: stale, owner not chosen; no
     * outcome ever comes. */
    d7.id = 7, d7.request = "r7", d7.time_ns = 7 * SEC, d7.owner_state = "SYNCING",
    d7.owner_blocks = 3, d7.chosen_state = "GAP", d7.chosen_blocks = 1;
    d7.cands[0] = (cand_spec){"A", "SYNCING", 3, 4};
    d7.cands[1] = (cand_spec){b, "GAP", 1, 2};
    /* D9: both LIVE again (closes both windows); its outcome comes from another instance id. */
    d9.id = 9, d9.request = "r9", d9.attempt = "1", d9.time_ns = 9 * SEC, d9.owner = NULL,
    d9.chosen_blocks = 0;
    d9.cands[0] = (cand_spec){"A", "LIVE", 0, 1};
    d9.cands[1] = (cand_spec){b, "LIVE", 0, 7};

    outcome_spec o8 = outcome_for(&d1, "complete", 200, 16, -1);
    o8.id = 99, o8.request = "r8", o8.worker = "A", o8.predicted_blocks = 2, o8.owner = "A",
    o8.owner_blocks = 2, o8.decided_ns = 8 * SEC;
    outcome_spec o9 = outcome_for(&d9, "complete", 200, 0, 6000000);
    o9.instance = "i2", o9.id = 500; /* joins only by (request_id, attempt_id) */

    write_record(f, make_decision(&d1));
    write_outcome_of(f, &d1, "complete", 200, 0, 2000000);
    write_outcome_of(f, &d2, "complete", 200, 160, 4000000);
    write_record(f, make_decision(&d2)); /* its outcome came first */
    write_record(f, make_decision(&d3));
    write_outcome_of(f, &d3, "incomplete", 200, 48, -1);
    write_record(f, make_decision(&d4));
    write_outcome_of(f, &d4, "error", 500, 32, -1);
    write_record(f, make_decision(&d5));
    write_outcome_of(f, &d5, "cancelled", -1, -1, -1);
    write_record(f, make_decision(&d6));
    write_outcome_of(f, &d6, "expired", -1, 32, -1);
    write_record(f, make_decision(&d7));
    write_record(f, make_outcome(&o8));
    write_record(f, make_decision(&d9));
    write_record(f, make_outcome(&o9));
    fclose(f);
}

#define EQ(actual, expected) \
    cr_expect_eq((uint64_t)(actual), (uint64_t)(expected), "%s = %" PRIu64 ", expected %" PRIu64, \
                 #actual, (uint64_t)(actual), (uint64_t)(expected))

Test(analyze, known_answers_every_metric, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    write_known_set(path, "B");
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    cr_assert(s);

    EQ(s->input.files, 1);
    EQ(s->input.lines, 16);
    EQ(s->input.invalid, 0);
    EQ(s->input.decisions, 8);
    EQ(s->input.outcomes, 8);
    EQ(s->input.hosts, 1);

    EQ(s->join.by_decision_id, 6);
    EQ(s->join.by_request, 1);
    EQ(s->join.decisions_without_outcome, 1);
    EQ(s->join.outcomes_without_decision, 1);
    EQ(s->join.duplicate_decisions, 0);
    EQ(s->join.copy_mismatches, 0);

    /* reuse: O1 0/0, O2 160/160, O3 80/48, O4 0/32, O5 null, O6 32/32, O8 32/16 (copy), O9 0/0 */
    EQ(s->reuse.outcomes, 8);
    EQ(s->reuse.unknown, 1);
    EQ(s->reuse.known, 7);
    EQ(s->reuse.from_outcome_copy, 1);
    EQ(s->reuse.predicted_tokens, 304);
    EQ(s->reuse.actual_tokens, 288);
    EQ(s->reuse.exact, 4);
    EQ(s->reuse.over_predicted, 2);
    EQ(s->reuse.over_predicted_tokens, 48);
    EQ(s->reuse.under_predicted, 1);
    EQ(s->reuse.under_predicted_tokens, 32);
    EQ(s->reuse.difference_buckets[6], 4);
    EQ(s->reuse.difference_buckets[4], 2);
    EQ(s->reuse.difference_buckets[8], 1);
    cr_expect_float_eq(s->reuse.mean_predicted_tokens, 304.0 / 7, 1e-9);

    /* owner: D1 (A 192 vs B 0) and D7 (A 48 vs B 16) not chosen; D4, D9 without owner */
    EQ(s->owner.decisions, 8);
    EQ(s->owner.no_owner, 2);
    EQ(s->owner.owner_is_chosen, 4);
    EQ(s->owner.owner_not_chosen, 2);
    cr_expect_float_eq(s->owner.owner_not_chosen_rate, 2.0 / 6, 1e-12);
    EQ(s->owner.owner_tokens, 240);
    EQ(s->owner.chosen_tokens, 16);
    EQ(s->owner.cost_tokens, 224);
    EQ(s->owner.joined_known, 1);
    EQ(s->owner.joined_actual_tokens, 0);
    EQ(s->owner.joined_owner_tokens, 192);

    EQ(s->staleness.events_decisions, 7);
    EQ(s->staleness.chosen_not_live, 1);
    EQ(s->staleness.owner_not_live, 1);
    EQ(s->staleness.stale_decisions, 1);
    EQ(s->staleness.approx_decisions, 1);

    EQ(s->outcomes.complete, 4);
    EQ(s->outcomes.incomplete, 1);
    EQ(s->outcomes.incomplete_http_200, 1);
    EQ(s->outcomes.error, 1);
    EQ(s->outcomes.cancelled, 1);
    EQ(s->outcomes.expired, 1);
    EQ(s->outcomes.ttft_known, 3);
    cr_expect_float_eq(s->outcomes.ttft_p50_ms, 4.0, 1e-9);
    cr_expect_float_eq(s->outcomes.ttft_p99_ms, 6.0, 1e-9);

    /* windows: A SYNCING and B GAP from D7 (7 s) until D9 (9 s) showed LIVE */
    cr_assert_eq(s->n_windows, 2);
    cr_expect_str_eq(s->windows[0].worker, "A");
    cr_expect_str_eq(s->windows[0].state, "SYNCING");
    cr_expect_str_eq(s->windows[1].worker, "B");
    cr_expect_str_eq(s->windows[1].state, "GAP");
    for (int i = 0; i < 2; i++) {
        cr_expect_str_eq(s->windows[i].host, "h1");
        cr_expect_str_eq(s->windows[i].pool, "p");
        EQ(s->windows[i].start_ns, 7 * SEC);
        EQ(s->windows[i].end_ns, 9 * SEC);
        cr_expect_eq(s->windows[i].open, 0);
        EQ(s->windows[i].inside.decisions, 1);
    }
    EQ(s->in_windows.decisions, 1);
    EQ(s->in_windows.owner_not_chosen, 1);
    EQ(s->in_windows.stale, 1);
    EQ(s->in_windows.known, 0);
    EQ(s->outside_windows.decisions, 7);
    EQ(s->outside_windows.owner_not_chosen, 1);
    EQ(s->outside_windows.known, 6);
    EQ(s->outside_windows.predicted_tokens, 272);
    EQ(s->outside_windows.actual_tokens, 272);
    EQ(s->outside_windows.exact, 4);
    EQ(s->outside_windows.prompt_tokens, 1664);
    EQ(s->outside_windows.actual_with_prompt, 240);
    cr_expect_float_eq(s->outside_windows.hit_rate, 240.0 / 1664, 1e-12);

    cr_assert_eq(s->n_policies, 2);
    cr_expect_str_eq(s->policies[0].policy, "cache_aware");
    EQ(s->policies[0].quality.decisions, 7);
    cr_expect_str_eq(s->policies[1].policy, "round_robin");
    EQ(s->policies[1].quality.decisions, 1);

    cr_assert_eq(s->n_workers, 3); /* by host, pool, worker: approxpool before p */
    cr_expect_str_eq(s->workers[0].pool, "approxpool");
    EQ(s->workers[0].chosen, 1);
    EQ(s->workers[0].in_flight_known, 0);
    cr_expect_str_eq(s->workers[1].worker, "A");
    EQ(s->workers[1].chosen, 3);
    cr_expect_float_eq(s->workers[1].mean_in_flight, 17.0 / 3, 1e-9);
    EQ(s->workers[1].max_in_flight, 9);
    cr_expect_str_eq(s->workers[2].worker, "B");
    EQ(s->workers[2].chosen, 4);
    cr_expect_float_eq(s->workers[2].mean_in_flight, 2.75, 1e-9);
    EQ(s->workers[2].max_in_flight, 7);

    cr_assert_eq(s->n_unjoined_decisions, 1);
    EQ(s->unjoined_decisions[0].line, 13);
    cr_expect(strstr(s->unjoined_decisions[0].what, "decision 7"), "%s", s->unjoined_decisions[0].what);
    cr_assert_eq(s->n_unjoined_outcomes, 1);
    EQ(s->unjoined_outcomes[0].line, 14);
    cr_expect_str_eq(s->unjoined_outcomes[0].file, path);

    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
    const char *t = km_text_cstr(&text);
    cr_expect(strstr(t, "unknown (null, not counted as 0) 1"), "%s", t);
    cr_expect(strstr(t, "incomplete 1 (1 of them with HTTP 200)"), "%s", t);
    cr_expect(strstr(t, "records.jsonl:13: decision 7 of instance i1 has no outcome"), "%s", t);
    km_text_free(&text);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, json_report_parses_with_the_same_numbers, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    write_known_set(path, "B");
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_json(a, &text), KM_OK);
    json_error_t error;
    json_t *root = json_loads(km_text_cstr(&text), 0, &error);
    cr_assert(root, "JSON report does not parse: %s", error.text);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(root, "reuse"), "known")), 7);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(root, "join"), "by_request")), 1);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(root, "owner"), "cost_tokens")), 224);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(root, "outcomes"),
                                                    "incomplete_http_200")), 1);
    json_t *windows = json_object_get(json_object_get(root, "recovery"), "windows");
    cr_expect_eq(json_array_size(windows), 2);
    cr_expect_eq(json_array_size(json_object_get(root, "policies")), 2);
    cr_expect_eq(json_array_size(json_object_get(root, "unjoined_decisions")), 1);
    cr_expect_eq(json_array_size(json_object_get(json_object_get(root, "reuse"), "difference_buckets")),
                 KM_ANALYSIS_DIFF_BUCKETS);
    /* the override keys are there with no override in the records */
    cr_expect_eq(json_count(root, "reuse", "overridden"), 0);
    cr_expect_eq(json_count(root, "reuse", "overridden_unpredicted"), 0);
    cr_expect_eq(json_count(root, "owner", "joined_overridden"), 0);
    cr_expect_eq(json_count(root, "owner", "overridden"), 0);
    cr_expect_eq(json_count(root, "owner", "overridden_to_owner"), 0);
    json_t *inside = json_object_get(json_object_get(root, "recovery"), "inside");
    cr_expect_eq(json_count(inside, NULL, "overridden"), 0);
    cr_expect_eq(json_count(inside, NULL, "overridden_unpredicted"), 0);
    json_t *window = json_array_get(windows, 0);
    cr_expect_eq(json_count(json_object_get(window, "inside"), NULL, "overridden"), 0);
    json_t *policy = json_array_get(json_object_get(root, "policies"), 0);
    cr_expect_eq(json_count(policy, NULL, "overridden_unpredicted"), 0);
    json_t *worker = json_array_get(json_object_get(root, "workers"), 0);
    cr_expect_eq(json_count(worker, NULL, "dispatched_by_override"), 0);
    /* the decision reasons, row by row as the summary has them */
    const km_analysis_summary *s = km_analysis_summary_get(a);
    json_t *reasons = json_object_get(root, "reasons");
    cr_assert_eq(json_array_size(reasons), s->n_reasons);
    cr_assert_gt(s->n_reasons, 0);
    for (size_t k = 0; k < s->n_reasons; k++) {
        json_t *row = json_array_get(reasons, k);
        cr_expect_str_eq(json_string_value(json_object_get(row, "policy")), s->reasons[k].policy);
        cr_expect_str_eq(json_string_value(json_object_get(row, "reason")), s->reasons[k].reason);
        cr_expect_eq(json_count(row, NULL, "decisions"), (int64_t)s->reasons[k].decisions);
        cr_expect_eq(json_count(row, NULL, "owner_not_chosen"),
                     (int64_t)s->reasons[k].owner_not_chosen);
        cr_expect_eq(json_count(row, NULL, "owner_not_weighed"),
                     (int64_t)s->reasons[k].owner_not_weighed);
        cr_expect_eq(json_count(row, NULL, "given_up_tokens"),
                     (int64_t)s->reasons[k].given_up_tokens);
    }
    json_decref(root);
    km_text_free(&text);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, null_cached_tokens_is_unknown_not_zero, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = NULL,
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A", .chosen_state = "LIVE",
                       .chosen_blocks = 3, .policy = "kv", .cands = {{"A", "LIVE", 3, 0}}, .n_cands = 1};
    decision_spec e = d;
    e.id = 2, e.request = "r2", e.time_ns = 20;
    write_record(f, make_decision(&d));
    write_outcome_of(f, &d, "complete", 200, 0, 5);  /* reported zero: a miss of 48 tokens */
    write_record(f, make_decision(&e));
    write_outcome_of(f, &e, "complete", 200, -1, 5); /* not reported */
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->reuse.known, 1);
    EQ(s->reuse.unknown, 1);
    EQ(s->reuse.predicted_tokens, 48);
    EQ(s->reuse.actual_tokens, 0);
    EQ(s->reuse.over_predicted, 1);
    EQ(s->reuse.exact, 0);
    EQ(s->outside_windows.known, 1);
    cr_expect_str_eq(s->workers[0].host, "", "a null host is the empty name");
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* A warm-up (decision.warm_up_for set, or an outcome whose attempt id ends ":warm_up" with its
 * decision missing) is a prefill nobody waited for: counted apart, in no figure, its time to
 * first token in no percentile. A warm_up_for that is not an integer >= 0 makes the line
 * invalid. */
Test(analyze, warm_ups_are_counted_apart_and_in_no_figure, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = NULL,
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A", .chosen_state = "LIVE",
                       .chosen_blocks = 3, .policy = "ttft", .reason = "min_ttft",
                       .cands = {{"A", "LIVE", 3, 0}, {"B", "LIVE", 0, 0}}, .n_cands = 2};
    decision_spec w = d;
    w.id = 2, w.attempt = "0:warm_up", w.time_ns = 11, w.owner = NULL, w.chosen = "B",
    w.chosen_blocks = 0, w.reason = "warm_up", w.warm_up = 1, w.warm_up_for = 1, w.n_cands = 1;
    w.cands[0] = (cand_spec){"B", "LIVE", 0, 0};
    decision_spec orphan = w;
    orphan.id = 3, orphan.request = "r3", orphan.attempt = ":warm_up";
    decision_spec bad = w;
    bad.id = 4, bad.request = "r4", bad.warm_up_for = -5;
    write_record(f, make_decision(&d));
    write_record(f, make_decision(&w));
    write_record(f, make_decision(&bad));
    write_outcome_of(f, &d, "complete", 200, 48, 5000000);
    write_outcome_of(f, &w, "complete", 200, 0, 90000000);
    write_outcome_of(f, &orphan, "error", 200, 0, 80000000);
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.decisions, 2);
    EQ(s->input.invalid, 1);
    EQ(s->input.outcomes, 3);
    EQ(s->input.warm_ups, 1);
    EQ(s->outcomes.complete, 1);
    EQ(s->outcomes.error, 0);
    EQ(s->outcomes.ttft_known, 1);
    cr_expect_float_eq(s->outcomes.ttft_p99_ms, 5.0, 1e-9);
    EQ(s->reuse.outcomes, 1);
    EQ(s->reuse.known, 1);
    EQ(s->join.outcomes_without_decision, 0);
    EQ(s->join.decisions_without_outcome, 0);
    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
    cr_assert(strstr(text.data, "1 of the decisions are warm-ups"), "%s", text.data);
    km_text_free(&text);
    json_t *root = json_report(a);
    cr_assert_eq(json_count(root, "input", "warm_ups"), 1);
    json_decref(root);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* A warm-up left unjoined (its decision without outcome, its outcome without decision) is in
 * neither join count, so neither list shows it: the lists name the counted records, the first
 * ones in reading order, and a run of warm-ups cannot crowd a real unjoined record out of them. */
Test(analyze, unjoined_warm_ups_are_not_listed, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec w = {.instance = "i", .id = 1, .request = "r1", .attempt = "0:warm_up",
                       .host = "h", .pool = "p", .time_ns = 10, .source = "events", .prompt = 64,
                       .chosen = "B", .chosen_state = "LIVE", .chosen_blocks = 0,
                       .policy = "ttft", .reason = "warm_up", .warm_up = 1, .warm_up_for = 7,
                       .cands = {{"B", "LIVE", 0, 0}}, .n_cands = 1};
    decision_spec d = w;
    d.id = 2, d.request = "r2", d.attempt = "0", d.reason = "min_ttft", d.warm_up = 0;
    decision_spec orphan_w = w;
    orphan_w.id = 3, orphan_w.request = "r3";
    decision_spec orphan = d;
    orphan.id = 4, orphan.request = "r4";
    write_record(f, make_decision(&w));      /* line 1: a warm-up without outcome */
    write_record(f, make_decision(&d));      /* line 2: a decision without outcome */
    write_outcome_of(f, &orphan_w, "complete", 200, 0, 1000); /* line 3: a warm-up's outcome */
    write_outcome_of(f, &orphan, "complete", 200, 0, 1000);   /* line 4 */
    fclose(f);
    const char *paths[] = {path};
    km_analysis_config cfg = {.max_listed = 1};
    km_analysis *a = analyze_files(&cfg, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.warm_ups, 1);
    EQ(s->join.decisions_without_outcome, 1);
    EQ(s->join.outcomes_without_decision, 1);
    EQ(s->n_unjoined_decisions, 1);
    EQ(s->n_unjoined_outcomes, 1);
    EQ(s->unjoined_decisions[0].line, 2);
    EQ(s->unjoined_outcomes[0].line, 4);
    km_analysis_destroy(a);
    a = analyze_files(NULL, paths, 1);
    json_t *root = json_report(a);
    EQ(json_array_size(json_object_get(root, "unjoined_decisions")), 1);
    EQ(json_array_size(json_object_get(root, "unjoined_outcomes")), 1);
    json_decref(root);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* An outcome whose attempt id ends ":warm_up" makes its pair a warm-up however it joins: by
 * decision id, or by (request_id, attempt_id) from another instance. Here neither decision names
 * warm_up_for; both pairs are warm-ups, in no figure. */
Test(analyze, a_warm_up_outcome_joined_by_request_makes_a_warm_up, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0:warm_up",
                       .host = "h", .pool = "p", .time_ns = 10, .source = "events", .prompt = 64,
                       .owner = "A", .owner_state = "LIVE", .owner_blocks = 3, .chosen = "B",
                       .chosen_state = "LIVE", .chosen_blocks = 0, .policy = "ttft",
                       .reason = "min_ttft",
                       .cands = {{"A", "LIVE", 3, 0}, {"B", "LIVE", 0, 0}}, .n_cands = 2};
    decision_spec e = d;
    e.id = 2, e.request = "r2";
    outcome_spec by_id = outcome_for(&d, "complete", 200, 0, 1000);
    outcome_spec by_request = outcome_for(&e, "complete", 200, 0, 1000);
    by_request.instance = "j", by_request.id = 9;
    write_record(f, make_decision(&d));
    write_record(f, make_decision(&e));
    write_record(f, make_outcome(&by_id));
    write_record(f, make_outcome(&by_request));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->join.by_decision_id, 1);
    EQ(s->join.by_request, 1);
    EQ(s->input.warm_ups, 2);
    EQ(s->owner.decisions, 0);
    EQ(s->owner.owner_not_chosen, 0);
    EQ(s->reuse.outcomes, 0);
    EQ(s->outcomes.complete, 0);
    EQ(s->n_policies, 0);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* A warm-up is in no figure of any section: not in the quality inside or outside the recovery
 * windows (nor a window's own), not in the load view, not in worker health. Here the warm-up
 * (worker B, GAP, inside A's window, ineligible, cluster load view, with a known reuse) would
 * change each of them. */
Test(analyze, warm_ups_are_in_no_quality_load_or_health_figure, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 3, .policy = "ttft",
                       .reason = "min_ttft", .cands = {{"A", "LIVE", 3, 0}}, .n_cands = 1};
    decision_spec w = d;
    w.id = 2, w.attempt = "0:warm_up", w.time_ns = 11, w.owner = NULL, w.chosen = "B",
    w.chosen_state = "GAP", w.chosen_blocks = 0, w.reason = "warm_up", w.warm_up = 1,
    w.warm_up_for = 1, w.n_cands = 1;
    w.cands[0] = (cand_spec){"B", "GAP", 0, 0};
    w.eligible[0] = ELIGIBLE_FALSE;
    json_t *wr = make_decision(&w);
    json_t *load = json_object_get(json_object_get(wr, "decision"), "load");
    json_object_set_new(load, "scope", json_string("cluster"));
    json_object_set_new(load, "instances", json_integer(1));
    json_object_set_new(load, "oldest_age_ms", json_real(99.0));
    json_object_set_new(load, "stale_instances", json_pack("[s]", "j"));
    decision_spec e = d; /* after the warm-up: B's window (opened by the warm-up) is still open */
    e.id = 3, e.request = "r3", e.time_ns = 12, e.n_cands = 2;
    e.cands[1] = (cand_spec){"B", "GAP", 0, 0};
    write_record(f, make_decision(&d));
    write_record(f, wr);
    write_record(f, make_decision(&e));
    write_outcome_of(f, &d, "complete", 200, 48, 5000000);
    write_outcome_of(f, &w, "complete", 200, 32, 90000000);
    write_outcome_of(f, &e, "complete", 200, 48, 5000000);
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.decisions, 3);
    EQ(s->input.warm_ups, 1);
    EQ(s->owner.decisions, 2);
    EQ(s->in_windows.decisions + s->outside_windows.decisions, 2);
    EQ(s->in_windows.known + s->outside_windows.known, 2);
    EQ(s->in_windows.actual_tokens + s->outside_windows.actual_tokens, 96);
    for (size_t i = 0; i < s->n_windows; i++)
        cr_expect_leq(s->windows[i].inside.decisions, 1, "window %zu holds the warm-up", i);
    EQ(s->load_view.this_instance, 2);
    EQ(s->load_view.cluster, 0);
    EQ(s->load_view.cluster_with_stale, 0);
    cr_expect_float_eq(s->load_view.oldest_age_ms_max, 0.0, 1e-12);
    EQ(s->health.decisions_with_ineligible, 0);
    EQ(s->health.ineligible_candidates, 0);
    for (size_t i = 0; i < s->n_workers; i++)
        EQ(s->workers[i].ineligible, 0);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, decisions_are_counted_by_their_load_view, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A", .chosen_state = "LIVE",
                       .chosen_blocks = 3, .policy = "kv", .cands = {{"A", "LIVE", 3, 0}}, .n_cands = 1};
    write_record(f, make_decision(&d)); /* this_instance */
    /* Each base scope alone or joined with engine_reported; the oldest age is over all of them. */
    const char *scope[] = {"cluster", "cluster+engine_reported", "cluster",
                           "this_instance+engine_reported", "this_instance+engine_reported"};
    const char *stale[] = {NULL, "b", NULL, NULL, NULL};
    const double age[] = {4.5, 31.25, 2.0, 40.0, 1.0};
    for (int i = 0; i < 5; i++) {
        decision_spec e = d;
        char req[16];
        snprintf(req, sizeof req, "c%d", i);
        e.id = 2 + i, e.request = req, e.time_ns = 20 + i;
        json_t *rec = make_decision(&e);
        json_t *load = json_object_get(json_object_get(rec, "decision"), "load");
        json_object_set_new(load, "scope", json_string(scope[i]));
        json_object_set_new(load, "instances", json_integer(i < 3 ? 2 : 0));
        json_object_set_new(load, "oldest_age_ms", json_real(age[i]));
        json_t *ids = json_array();
        if (stale[i])
            json_array_append_new(ids, json_string(stale[i]));
        json_object_set_new(load, "stale_instances", ids);
        write_record(f, rec);
    }
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->load_view.this_instance, 3);
    EQ(s->load_view.cluster, 3);
    EQ(s->load_view.cluster_with_stale, 1);
    EQ(s->load_view.engine_reported, 3);
    cr_expect_float_eq(s->load_view.oldest_age_ms_max, 40.0, 1e-9);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* A problem's text quotes what a line holds, cut to a length, and names the file: either may not
 * be UTF-8 (a cut character, a Latin-1 file name), and the JSON report, which can only carry UTF-8,
 * still lists every problem, with U+FFFD where a character could not be shown. */
Test(analyze, invalid_lines_are_listed_in_json_whatever_their_bytes, .timeout = 10)
{
    char dir[64], path[160];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "caf\xe9.jsonl", path, sizeof path); /* Latin-1 in the file name */
    fputs("{\"type\":\"a", f); /* an unknown type of 81 bytes, cut at 64 inside a character */
    for (int i = 0; i < 40; i++)
        fputs("\xc3\xa9", f);
    fputs("\",\"schema_version\":1}\n{\"type\":\"x\",\"schema_version\":1}\n", f);
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.invalid, 2);
    json_t *root = json_report(a);
    json_t *listed = json_object_get(root, "invalid_lines");
    cr_assert(json_is_array(listed), "no invalid_lines array");
    cr_assert_eq(json_array_size(listed), 2, "a problem with bytes that are not UTF-8 was dropped");
    for (size_t i = 0; i < 2; i++) {
        json_t *item = json_array_get(listed, i);
        cr_assert_eq(json_integer_value(json_object_get(item, "line")), (json_int_t)(i + 1));
        cr_assert(strstr(json_string_value(json_object_get(item, "file")), "caf\xef\xbf\xbd"),
                  "%s", json_string_value(json_object_get(item, "file")));
    }
    json_decref(root);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, invalid_lines_are_counted_with_file_and_line, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "bad.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = NULL,
                       .chosen = "A", .chosen_state = "LIVE", .policy = "kv",
                       .cands = {{"A", "LIVE", 0, 0}}, .n_cands = 1};
    write_record(f, make_decision(&d));                                            /* 1 valid */
    fprintf(f, "{\"type\": \"decision\", oops\n");                                 /* 2 */
    fprintf(f, "[1, 2, 3]\n");                                                     /* 3 */
    fprintf(f, "{\"type\":\"heartbeat\",\"schema_version\":1}\n");                 /* 4 */
    fprintf(f, "{\"type\":\"decision\",\"schema_version\":2}\n");                  /* 5 */
    json_t *no_candidates = make_decision(&d);
    json_object_del(no_candidates, "candidates");
    write_record(f, no_candidates);                                                /* 6 */
    outcome_spec o = outcome_for(&d, "complete", 200, 0, 1);
    json_t *bad_cached = make_outcome(&o);
    json_object_set_new(bad_cached, "cached_tokens", json_string("12"));
    write_record(f, bad_cached);                                                   /* 7 */
    fprintf(f, "   \n");                                                           /* 8 blank */
    for (int i = 0; i < 5000; i++)                                                 /* 9 too long */
        fputc('x', f);
    fputc('\n', f);
    json_t *bad_outcome = make_outcome(&o);
    json_object_set_new(bad_outcome, "outcome", json_string("finished"));
    write_record(f, bad_outcome);                                                  /* 10 */
    write_outcome_of(f, &d, "complete", 200, 0, 1);                                /* 11 valid */
    json_t *no_pool = make_decision(&d);
    json_object_del(no_pool, "pool");
    write_record(f, no_pool);                                                      /* 12 */
    json_t *bad_source = make_decision(&d);
    json_object_set_new(json_object_get(bad_source, "prediction"), "source", json_string("guess"));
    write_record(f, bad_source);                                                   /* 13 */
    fprintf(f, "{\"type\":\"outcome\",\"schema_ver");                              /* 14 cut */
    fclose(f);

    km_analysis_config cfg = {.max_line_bytes = 4096};
    const char *paths[] = {path};
    km_analysis *a = analyze_files(&cfg, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.lines, 14);
    EQ(s->input.blank_lines, 1);
    EQ(s->input.invalid, 11);
    EQ(s->input.decisions, 1);
    EQ(s->input.outcomes, 1);
    EQ(s->join.by_decision_id, 1);
    cr_assert_eq(s->n_invalid_lines, 11);
    const struct {
        uint64_t line;
        const char *says;
    } expected[] = {{2, "not JSON"},
                    {3, "not a JSON object"},
                    {4, "unknown record type \"heartbeat\""},
                    {5, "schema_version 2 is not supported"},
                    {6, "field candidates: missing"},
                    {7, "field cached_tokens: expected a non-negative integer or null"},
                    {9, "line longer than 4096 bytes"},
                    {10, "field outcome: expected complete"},
                    {12, "decision record: field pool: missing"},
                    {13, "field prediction.source: expected \"events\" or \"approx\""},
                    {14, "not JSON"}};
    for (size_t i = 0; i < 11; i++) {
        EQ(s->invalid_lines[i].line, expected[i].line);
        cr_expect_str_eq(s->invalid_lines[i].file, path);
        cr_expect(strstr(s->invalid_lines[i].what, expected[i].says), "line %" PRIu64 ": '%s' lacks '%s'",
                  s->invalid_lines[i].line, s->invalid_lines[i].what, expected[i].says);
    }
    km_analysis_destroy(a);

    /* the listing is bounded, the count is not */
    cfg.max_listed = 3;
    a = analyze_files(&cfg, paths, 1);
    s = km_analysis_summary_get(a);
    EQ(s->input.invalid, 11);
    EQ(s->n_invalid_lines, 3);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, rotated_files_join_in_any_order, .timeout = 20)
{
    char dir[64], p0[128], p1[128], p2[128];
    make_temp_dir(dir);
    FILE *f2 = open_in(dir, "rec.jsonl.2", p2, sizeof p2);
    FILE *f1 = open_in(dir, "rec.jsonl.1", p1, sizeof p1);
    FILE *f0 = open_in(dir, "rec.jsonl", p0, sizeof p0);
    char requests[22][16];
    decision_spec d[21];
    for (int i = 1; i <= 20; i++) {
        snprintf(requests[i], sizeof requests[i], "r%d", i);
        d[i] = (decision_spec){.instance = "inst", .id = i, .request = requests[i], .attempt = "0",
                               .host = "h", .pool = "p", .time_ns = i * SEC, .source = "events",
                               .prompt = 100, .owner = "A", .owner_state = "LIVE",
                               .owner_blocks = 2, .chosen = "A", .chosen_state = "LIVE",
                               .chosen_blocks = 2, .policy = "kv",
                               .cands = {{"A", i >= 5 && i < 8 ? "GAP" : "LIVE", 2, i}},
                               .n_cands = 1};
        if (i >= 5 && i < 8)
            d[i].owner_state = d[i].chosen_state = "GAP";
        write_record(i <= 10 ? f2 : f1, make_decision(&d[i]));
    }
    fprintf(f2, "{\"type\":\"decis"); /* a crash cut the oldest file's last line */
    for (int i = 1; i <= 20; i++)
        write_outcome_of(i <= 15 ? f1 : f0, &d[i], "complete", 200, 32, 1000);
    outcome_spec orphan = outcome_for(&d[1], "complete", 200, 32, 1000);
    orphan.id = 21, orphan.request = "r21";
    write_record(f0, make_outcome(&orphan));
    fclose(f0);
    fclose(f1);
    fclose(f2);

    const char *orders[3][3] = {{p2, p1, p0}, {p0, p1, p2}, {p1, p0, p2}};
    for (int k = 0; k < 3; k++) {
        km_analysis *a = analyze_files(NULL, orders[k], 3);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        EQ(s->input.files, 3);
        EQ(s->input.invalid, 1);
        cr_expect_str_eq(s->invalid_lines[0].file, p2);
        EQ(s->invalid_lines[0].line, 11);
        EQ(s->join.by_decision_id, 20);
        EQ(s->join.by_request, 0);
        EQ(s->join.decisions_without_outcome, 0);
        EQ(s->join.outcomes_without_decision, 1);
        EQ(s->reuse.exact, 21);
        /* the GAP run spans decisions 5..7 in one file: one window, closed by decision 8 */
        cr_assert_eq(s->n_windows, 1);
        EQ(s->windows[0].start_ns, 5 * SEC);
        EQ(s->windows[0].end_ns, 8 * SEC);
        EQ(s->windows[0].inside.decisions, 3);
        EQ(s->staleness.stale_decisions, 3);
        km_analysis_destroy(a);
    }
    remove_dir(dir);
}

Test(analyze, windows_across_files_and_never_closed, .timeout = 10)
{
    char dir[64], px[128], py[128];
    make_temp_dir(dir);
    FILE *fx = open_in(dir, "x.jsonl", px, sizeof px);
    FILE *fy = open_in(dir, "y.jsonl", py, sizeof py);
    /* A: GAP at 1, 2, 3 (file x), LIVE at 5 (file y). B: DEGRADED at 4 (x) and 6 (y), never LIVE
     * after. */
    const char *a_state[5] = {NULL, "GAP", "GAP", "GAP", "LIVE"};
    const char *b_state[5] = {NULL, "LIVE", "LIVE", "LIVE", "DEGRADED"};
    char requests[5][8];
    for (int i = 1; i <= 4; i++) {
        snprintf(requests[i], sizeof requests[i], "r%d", i);
        decision_spec d = {.instance = "i", .id = i, .request = requests[i], .attempt = "0",
                           .host = "h", .pool = "p", .time_ns = i * SEC, .source = "events",
                           .prompt = 10, .owner = NULL, .chosen = "B", .chosen_state = b_state[i],
                           .policy = "kv", .cands = {{"A", a_state[i], 0, 1}, {"B", b_state[i], 0, 1}},
                           .n_cands = 2};
        if (i == 4) /* A's LIVE at 4 is hidden: A is absent from decision 4 */
            d.cands[0] = d.cands[1], d.n_cands = 1;
        write_record(fx, make_decision(&d));
    }
    fclose(fx);
    decision_spec d5 = {.instance = "i", .id = 5, .request = "r5", .attempt = "0", .host = "h",
                        .pool = "p", .time_ns = 5 * SEC, .source = "events", .prompt = 10,
                        .owner = NULL, .chosen = "A", .chosen_state = "LIVE", .policy = "kv",
                        .cands = {{"A", "LIVE", 0, 1}, {"B", "DEGRADED", 0, 1}}, .n_cands = 2};
    write_record(fy, make_decision(&d5));
    decision_spec d6 = d5;
    d6.id = 6, d6.request = "r6", d6.time_ns = 6 * SEC;
    write_record(fy, make_decision(&d6));
    fclose(fy);

    const char *paths[] = {py, px};
    km_analysis *a = analyze_files(NULL, paths, 2);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    cr_assert_eq(s->n_windows, 2);
    cr_expect_str_eq(s->windows[0].worker, "A");
    EQ(s->windows[0].start_ns, 1 * SEC);
    EQ(s->windows[0].end_ns, 5 * SEC);
    cr_expect_eq(s->windows[0].open, 0);
    EQ(s->windows[0].inside.decisions, 4); /* 1, 2, 3, 4 */
    cr_expect_str_eq(s->windows[1].worker, "B");
    cr_expect_str_eq(s->windows[1].state, "DEGRADED");
    EQ(s->windows[1].start_ns, 4 * SEC);
    EQ(s->windows[1].end_ns, 6 * SEC);
    cr_expect_eq(s->windows[1].open, 1);
    EQ(s->windows[1].inside.decisions, 3); /* 4, 5, 6: an open window includes its end */
    EQ(s->in_windows.decisions, 6);
    EQ(s->outside_windows.decisions, 0);
    EQ(s->join.decisions_without_outcome, 6);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, duplicates_are_counted_not_used, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "dup.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = NULL,
                       .chosen = "A", .chosen_state = "LIVE", .chosen_blocks = 1, .policy = "kv",
                       .cands = {{"A", "LIVE", 1, 0}}, .n_cands = 1};
    write_record(f, make_decision(&d));
    write_record(f, make_decision(&d));
    write_outcome_of(f, &d, "complete", 200, 16, 1);
    write_outcome_of(f, &d, "error", 500, 0, 1);
    /* an outcome whose copy of the prediction disagrees with its decision */
    decision_spec e = d;
    e.id = 2, e.request = "r2";
    write_record(f, make_decision(&e));
    outcome_spec o = outcome_for(&e, "complete", 200, 16, 1);
    o.worker = "Z";
    write_record(f, make_outcome(&o));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.decisions, 3);
    EQ(s->input.outcomes, 3);
    EQ(s->join.duplicate_decisions, 1);
    EQ(s->join.duplicate_outcomes, 1);
    EQ(s->join.by_decision_id, 2);
    EQ(s->join.copy_mismatches, 1);
    EQ(s->owner.decisions, 2);
    EQ(s->outcomes.complete, 2);
    EQ(s->outcomes.error, 0);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, errors_and_lifecycle, .timeout = 10)
{
    km_analysis *a = NULL;
    cr_assert_eq(km_analysis_create(NULL, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_analysis_create(NULL, &a), KM_OK);
    cr_expect_null(km_analysis_summary_get(a), "no summary before finish");
    km_text t;
    km_text_init(&t, 0);
    cr_expect_eq(km_analysis_render_text(a, &t), KM_ERR_INVALID_ARGUMENT);
    cr_expect_eq(km_analysis_add_file(a, "/nonexistent/km-analyze.jsonl"), KM_ERR_IO);
    cr_expect(strstr(km_analysis_last_error(a), "/nonexistent/km-analyze.jsonl"), "%s",
              km_analysis_last_error(a));
    cr_expect_eq(km_analysis_add_file(a, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_analysis_finish(a), KM_OK);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.files, 0);
    EQ(s->input.files_failed, 1);
    cr_expect_eq(km_analysis_add_file(a, "/dev/null"), KM_ERR_INVALID_ARGUMENT);
    cr_expect_eq(km_analysis_finish(a), KM_ERR_INVALID_ARGUMENT);
    cr_expect_eq(km_analysis_render_text(a, &t), KM_OK, "an empty analysis still reports");
    cr_expect_eq(km_analysis_render_html(a, &t), KM_OK);
    cr_expect_eq(km_analysis_write_html(a, "/nonexistent/dir/report.html"), KM_ERR_IO);
    km_text_free(&t);
    km_analysis_destroy(a);
    km_analysis_destroy(NULL);
}

Test(analyze, difference_buckets_edges, .timeout = 5)
{
    const struct {
        int64_t d;
        uint32_t bucket;
    } cases[] = {{INT64_MIN + 1, 0}, {-4096, 0}, {-4095, 1}, {-1024, 1}, {-1023, 2}, {-256, 2},
                 {-255, 3}, {-64, 3}, {-63, 4}, {-16, 4}, {-15, 5}, {-1, 5}, {0, 6}, {1, 7},
                 {15, 7}, {16, 8}, {63, 8}, {64, 9}, {255, 9}, {256, 10}, {1023, 10}, {1024, 11},
                 {4095, 11}, {4096, 12}, {INT64_MAX, 12}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(km_analysis_diff_bucket(cases[i].d), cases[i].bucket, "d=%" PRId64 ": %u",
                     cases[i].d, km_analysis_diff_bucket(cases[i].d));
    cr_expect_str_eq(km_analysis_diff_bucket_label(6), "0");
    cr_expect_str_eq(km_analysis_diff_bucket_label(99), "?");
}

/* ---- router overrides ---------------------------------------------------------------------- */

/* kvmatch chose A, whose 4 blocks predicted 64 cached tokens; the router sent the attempt to B
 * instead (dispatched_worker), a candidate holding 2 blocks of 16 = 32 tokens, and B's engine
 * reported 32 cached tokens: the prediction for the worker that served it was exact. Checked with
 * the outcome read after its decision (the decision's candidates kept until it comes), before it,
 * and joined only at finish by (request_id, attempt_id). */
Test(analyze, override_is_compared_with_the_dispatched_workers_depth, .timeout = 20)
{
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 128,
                       .owner = "A", .owner_state = "LIVE", .owner_blocks = 4, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 4, .policy = "kv",
                       .cands = {{"A", "LIVE", 4, 1}, {"B", "LIVE", 2, 0}}, .n_cands = 2};
    for (int layout = 0; layout < 4; layout++) {
        char dir[64], path[128];
        make_temp_dir(dir);
        FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
        outcome_spec o = outcome_for(&d, "complete", 200, 32, 5);
        o.dispatched = "B";
        if (layout >= 2)
            o.instance = "other", o.id = 77;
        if (layout == 3) /* an instance on another host: the same workers, named from there */
            o.host = "h2";
        if (layout == 1)
            write_record(f, make_outcome(&o));
        write_record(f, make_decision(&d));
        if (layout != 1)
            write_record(f, make_outcome(&o));
        fclose(f);
        const char *paths[] = {path};
        km_analysis *a = analyze_files(NULL, paths, 1);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        cr_log_info("layout %d", layout);
        EQ(s->join.by_decision_id, layout < 2);
        EQ(s->join.by_request, layout >= 2);
        EQ(s->join.copy_mismatches, 0);
        EQ(s->reuse.outcomes, 1);
        EQ(s->reuse.known, 1);
        EQ(s->reuse.overridden, 1);
        EQ(s->reuse.overridden_unpredicted, 0);
        EQ(s->reuse.predicted_tokens, 32);
        EQ(s->reuse.actual_tokens, 32);
        EQ(s->reuse.exact, 1);
        EQ(s->reuse.over_predicted, 0);
        EQ(s->reuse.under_predicted, 0);
        EQ(s->reuse.difference_buckets[6], 1);
        EQ(s->owner.owner_is_chosen, 1);
        EQ(s->owner.overridden, 1);
        EQ(s->owner.overridden_to_owner, 0);
        EQ(s->outside_windows.known, 1);
        EQ(s->outside_windows.overridden, 1);
        EQ(s->outside_windows.predicted_tokens, 32);
        EQ(s->outside_windows.exact, 1);
        cr_assert_eq(s->n_policies, 1);
        EQ(s->policies[0].quality.predicted_tokens, 32);
        EQ(s->policies[0].quality.exact, 1);
        cr_assert_eq(s->n_workers, 2);
        cr_expect_str_eq(s->workers[0].worker, "A");
        EQ(s->workers[0].chosen, 1);
        EQ(s->workers[0].dispatched_by_override, 0);
        cr_expect_str_eq(s->workers[1].worker, "B");
        EQ(s->workers[1].chosen, 0);
        EQ(s->workers[1].dispatched_by_override, 1);
        for (size_t w = 0; w < s->n_workers; w++)
            cr_expect_str_eq(s->workers[w].host, "h"); /* the decision's host names them */

        json_t *root = json_report(a);
        cr_expect_eq(json_count(root, "reuse", "overridden"), 1);
        cr_expect_eq(json_count(root, "reuse", "overridden_unpredicted"), 0);
        cr_expect_eq(json_count(root, "reuse", "exact"), 1);
        cr_expect_eq(json_count(root, "owner", "overridden"), 1);
        cr_expect_eq(json_count(root, "owner", "overridden_to_owner"), 0);
        cr_expect_eq(json_count(root, "owner", "joined_overridden"), 0);
        json_t *policy = json_array_get(json_object_get(root, "policies"), 0);
        cr_expect_eq(json_count(policy, NULL, "overridden"), 1);
        cr_expect_eq(json_count(policy, NULL, "overridden_unpredicted"), 0);
        json_t *outside = json_object_get(json_object_get(root, "recovery"), "outside");
        cr_expect_eq(json_count(outside, NULL, "overridden"), 1);
        json_t *b = json_array_get(json_object_get(root, "workers"), 1);
        cr_expect_eq(json_count(b, NULL, "dispatched_by_override"), 1);
        json_decref(root);

        km_text text;
        km_text_init(&text, 0);
        cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
        const char *t = km_text_cstr(&text);
        cr_expect(strstr(t, "router overrides (dispatched_worker): 1 compared with the dispatched "
                            "worker's depth, 0 not compared"), "%s", t);
        cr_expect(strstr(t, "p/B: chosen 0 (0.0%), in_flight mean 0.00 max 0, sent here by router "
                            "override 1"), "%s", t);
        km_text_free(&text);
        km_analysis_destroy(a);
        remove_dir(dir);
    }
}

/* An instance writes each outcome with its decision's id, so a decision and an outcome of one
 * instance left unjoined by decision id are never a pair, even for the same request: a retry's
 * decision (no outcome yet) and the outcome of the attempt before it, whose decision is in a file
 * not given, stay one decision without outcome and one outcome without decision. From another
 * instance, the same request pairs them. */
Test(analyze, leftovers_of_one_instance_are_not_joined_by_request, .timeout = 20)
{
    decision_spec d = {.instance = "i", .id = 101, .request = "r1", .attempt = "", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 128,
                       .owner = "A", .owner_state = "LIVE", .owner_blocks = 4, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 4, .policy = "kv",
                       .cands = {{"A", "LIVE", 4, 1}, {"B", "LIVE", 2, 0}}, .n_cands = 2};
    for (int other_instance = 0; other_instance < 2; other_instance++) {
        char dir[64], path[128];
        make_temp_dir(dir);
        FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
        outcome_spec o = outcome_for(&d, "complete", 200, 16, 5);
        o.id = 100; /* the attempt before the retry */
        if (other_instance)
            o.instance = "j";
        write_record(f, make_outcome(&o));
        write_record(f, make_decision(&d));
        fclose(f);
        const char *paths[] = {path};
        km_analysis *a = analyze_files(NULL, paths, 1);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        cr_log_info("other instance %d", other_instance);
        EQ(s->join.by_decision_id, 0);
        EQ(s->join.by_request, other_instance);
        EQ(s->join.decisions_without_outcome, !other_instance);
        EQ(s->join.outcomes_without_decision, !other_instance);
        km_analysis_destroy(a);
        remove_dir(dir);
    }
}

/* An override to a worker the decision has no candidate row for, or of an outcome without its
 * decision, predicts nothing for the worker that served it: counted, never compared. The owner
 * section does not credit the chosen worker with reuse that happened on another worker, and counts
 * the overrides, those to the prediction owner apart. */
Test(analyze, override_without_a_prediction_and_the_owner, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    /* the owner B (3 blocks) not chosen: kvmatch chose A (0 blocks) */
    decision_spec d1 = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                        .pool = "p", .time_ns = 10, .source = "events", .prompt = 100,
                        .owner = "B", .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A",
                        .chosen_state = "LIVE", .chosen_blocks = 0, .policy = "cache_aware",
                        .cands = {{"A", "LIVE", 0, 1}, {"B", "LIVE", 3, 9}}, .n_cands = 2};
    decision_spec d2 = d1, d3 = d1, d6 = d1;
    d2.id = 2, d2.request = "r2", d2.time_ns = 20;
    d3.id = 3, d3.request = "r3", d3.time_ns = 30;
    d6.id = 6, d6.request = "r6", d6.time_ns = 60;
    outcome_spec o1 = outcome_for(&d1, "complete", 200, 48, 5); /* sent to the owner: exact */
    o1.dispatched = "B";
    outcome_spec o2 = outcome_for(&d2, "complete", 200, 16, 5); /* C is no candidate */
    o2.dispatched = "C";
    outcome_spec o3 = outcome_for(&d3, "complete", 200, 0, 5);  /* no override */
    outcome_spec o6 = outcome_for(&d6, "complete", 200, -1, 5); /* to the owner, cached unknown */
    o6.dispatched = "B";
    outcome_spec o4 = outcome_for(&d1, "complete", 200, 16, 5); /* no decision, overridden */
    o4.id = 4, o4.request = "r4", o4.dispatched = "B";
    outcome_spec o5 = outcome_for(&d1, "complete", 200, 16, 5); /* no decision, not overridden */
    o5.id = 5, o5.request = "r5", o5.predicted_blocks = 1;
    write_record(f, make_decision(&d1));
    write_record(f, make_decision(&d2));
    write_record(f, make_outcome(&o2));
    write_record(f, make_outcome(&o1));
    write_record(f, make_decision(&d3));
    write_record(f, make_outcome(&o3));
    write_record(f, make_outcome(&o4));
    write_record(f, make_outcome(&o5));
    write_record(f, make_outcome(&o6));
    write_record(f, make_decision(&d6));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->join.by_decision_id, 4);
    EQ(s->join.outcomes_without_decision, 2);
    EQ(s->join.copy_mismatches, 0);
    /* compared: O1 48/48 (B's row), O3 0/0, O5 16/16 (its copy); O2, O4 not; O6 unknown */
    EQ(s->reuse.outcomes, 6);
    EQ(s->reuse.unknown, 1);
    EQ(s->reuse.overridden_unpredicted, 2);
    EQ(s->reuse.known, 3);
    EQ(s->reuse.overridden, 1);
    EQ(s->reuse.from_outcome_copy, 1);
    EQ(s->reuse.predicted_tokens, 64);
    EQ(s->reuse.actual_tokens, 64);
    EQ(s->reuse.exact, 3);
    EQ(s->reuse.over_predicted + s->reuse.under_predicted, 0);

    EQ(s->owner.decisions, 4);
    EQ(s->owner.owner_not_chosen, 4);
    EQ(s->owner.owner_tokens, 4 * 48);
    EQ(s->owner.chosen_tokens, 0);
    EQ(s->owner.joined_known, 1); /* D3 only: A served it */
    EQ(s->owner.joined_actual_tokens, 0);
    EQ(s->owner.joined_owner_tokens, 48);
    EQ(s->owner.joined_overridden, 2); /* D1 and D2: another worker reported that reuse */
    EQ(s->owner.overridden, 3);
    EQ(s->owner.overridden_to_owner, 2);

    EQ(s->outside_windows.decisions, 4);
    EQ(s->outside_windows.known, 2);
    EQ(s->outside_windows.overridden, 1);
    EQ(s->outside_windows.overridden_unpredicted, 1);
    EQ(s->outside_windows.predicted_tokens, 48);
    EQ(s->outside_windows.actual_tokens, 48);
    EQ(s->outside_windows.exact, 2);
    EQ(s->outside_windows.prompt_tokens, 200);
    EQ(s->outside_windows.actual_with_prompt, 48);

    cr_assert_eq(s->n_workers, 3);
    cr_expect_str_eq(s->workers[0].worker, "A");
    EQ(s->workers[0].chosen, 4);
    EQ(s->workers[0].dispatched_by_override, 0);
    cr_expect_str_eq(s->workers[1].worker, "B");
    EQ(s->workers[1].chosen, 0);
    EQ(s->workers[1].dispatched_by_override, 3); /* O1, O4, O6 */
    cr_expect_str_eq(s->workers[2].worker, "C");
    EQ(s->workers[2].dispatched_by_override, 1);

    km_text page;
    km_text_init(&page, 0);
    cr_assert_eq(km_analysis_render_html(a, &page), KM_OK);
    const char *h = km_text_cstr(&page);
    cr_expect(strstr(h, "<tr><td>router overrides: compared with the dispatched worker's depth / "
                        "not compared (no prediction for it)</td><td>1 / 2</td></tr>"), "%s", h);
    cr_expect(strstr(h, "<tr><td>decisions overridden by the router / sent to the prediction "
                        "owner</td><td>3 / 2</td></tr>"), "%s", h);
    cr_expect_eq(count_of(h, "<circle "), 3, "one dot per compared outcome");
    km_text_free(&page);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* An outcome's worker and predicted copy are the decision's chosen worker's even when the router
 * overrode it (RECORDS.md): an override is no copy mismatch, a worker field naming the worker the
 * router used is one. */
Test(analyze, override_is_not_a_copy_mismatch, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 2, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 2, .policy = "kv",
                       .cands = {{"A", "LIVE", 2, 0}, {"B", "LIVE", 1, 0}}, .n_cands = 2};
    decision_spec e = d;
    e.id = 2, e.request = "r2", e.time_ns = 20;
    write_record(f, make_decision(&d));
    outcome_spec o = outcome_for(&d, "complete", 200, 16, 1);
    o.dispatched = "B"; /* worker stays A, predicted stays A's 2 blocks */
    write_record(f, make_outcome(&o));
    write_record(f, make_decision(&e));
    outcome_spec wrong = outcome_for(&e, "complete", 200, 16, 1);
    wrong.worker = "B"; /* a copy that names another worker than the decision chose */
    write_record(f, make_outcome(&wrong));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->join.by_decision_id, 2);
    EQ(s->join.copy_mismatches, 1);
    EQ(s->reuse.overridden, 1);
    EQ(s->reuse.exact, 1);           /* the override: B's 16 against 16 */
    EQ(s->reuse.over_predicted, 1);  /* the other: A's 32 against 16 */
    EQ(s->reuse.predicted_tokens, 48);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* dispatched_worker is a string, null or absent; anything else makes the line invalid, naming the
 * field. A dispatched_worker naming the chosen worker is no override. A candidate needs its
 * depth_tokens (an override is compared with it). */
Test(analyze, dispatched_worker_must_be_a_string_or_null, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 2, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 2, .policy = "kv",
                       .cands = {{"A", "LIVE", 2, 0}, {"B", "LIVE", 1, 0}}, .n_cands = 2};
    decision_spec e = d;
    e.id = 2, e.request = "r2", e.time_ns = 20;
    write_record(f, make_decision(&d));                                      /* 1 */
    outcome_spec o = outcome_for(&d, "complete", 200, 32, 1);
    json_t *number = make_outcome(&o);
    json_object_set_new(number, "dispatched_worker", json_integer(5));
    write_record(f, number);                                                 /* 2 invalid */
    json_t *list = make_outcome(&o);
    json_object_set_new(list, "dispatched_worker", json_pack("[s]", "B"));
    write_record(f, list);                                                   /* 3 invalid */
    json_t *no_depth = make_decision(&e);
    json_object_del(json_array_get(json_object_get(no_depth, "candidates"), 1), "depth_tokens");
    write_record(f, no_depth);                                               /* 4 invalid */
    json_t *absent = make_outcome(&o);
    json_object_del(absent, "dispatched_worker");
    write_record(f, absent);                                                 /* 5: no override */
    write_record(f, make_decision(&e));                                      /* 6 */
    outcome_spec same = outcome_for(&e, "complete", 200, 32, 1);
    same.dispatched = "A";
    write_record(f, make_outcome(&same));                                    /* 7: no override */
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.invalid, 3);
    cr_assert_eq(s->n_invalid_lines, 3);
    EQ(s->invalid_lines[0].line, 2);
    cr_expect_str_eq(s->invalid_lines[0].what,
                     "outcome record: field dispatched_worker: expected a string or null");
    EQ(s->invalid_lines[1].line, 3);
    cr_expect_str_eq(s->invalid_lines[1].what,
                     "outcome record: field dispatched_worker: expected a string or null");
    EQ(s->invalid_lines[2].line, 4);
    cr_expect_str_eq(s->invalid_lines[2].what,
                     "decision record: field candidates[1].depth_tokens: missing");
    EQ(s->join.by_decision_id, 2);
    EQ(s->reuse.known, 2);
    EQ(s->reuse.exact, 2);
    EQ(s->reuse.overridden, 0);
    EQ(s->reuse.overridden_unpredicted, 0);
    EQ(s->owner.overridden, 0);
    for (size_t i = 0; i < s->n_workers; i++)
        EQ(s->workers[i].dispatched_by_override, 0);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* Worker health: the owner != chosen decisions split by the owner's eligibility, each part with
 * its counts and reuse forgone; decisions with an ineligible candidate; per worker, the decisions
 * it was ineligible in and owned while ineligible. A record without the field (written before it)
 * counts every row eligible; an `eligible` that is not a boolean makes the line invalid. */
Test(analyze, ineligible_owner_is_split_from_the_policys_choice, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    enum { T = ELIGIBLE_TRUE, F = ELIGIBLE_FALSE };
    /* D1: the owner B (8 blocks) ineligible, A (2) chosen; served by A with 32 cached tokens */
    decision_spec d1 = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                        .pool = "p", .time_ns = 10, .source = "events", .prompt = 200,
                        .owner = "B", .owner_state = "LIVE", .owner_blocks = 8, .chosen = "A",
                        .chosen_state = "LIVE", .chosen_blocks = 2, .policy = "kv",
                        .cands = {{"A", "LIVE", 2, 0}, {"C", "LIVE", 0, 0}, {"B", "LIVE", 8, 0}},
                        .eligible = {T, T, F}, .n_cands = 3};
    /* D2: the owner A (5) eligible, C (1) chosen, B ineligible; the router sent it to A */
    decision_spec d2 = d1;
    d2.id = 2, d2.request = "r2", d2.time_ns = 20, d2.owner = "A", d2.owner_blocks = 5,
    d2.chosen = "C", d2.chosen_blocks = 1;
    d2.cands[0] = (cand_spec){"A", "LIVE", 5, 0};
    d2.cands[1] = (cand_spec){"C", "LIVE", 1, 0};
    d2.cands[2] = (cand_spec){"B", "LIVE", 0, 0};
    /* D3: a record from before the field: the owner A chosen */
    decision_spec d3 = d1;
    d3.id = 3, d3.request = "r3", d3.time_ns = 30, d3.owner = "A", d3.owner_blocks = 3,
    d3.chosen_blocks = 3;
    d3.cands[0] = (cand_spec){"A", "LIVE", 3, 0};
    d3.eligible[0] = ELIGIBLE_ABSENT;
    d3.n_cands = 1;
    /* D4: the owner B (6) ineligible, C (3) ineligible too, A (0) chosen; cached tokens unknown */
    decision_spec d4 = d1;
    d4.id = 4, d4.request = "r4", d4.time_ns = 40, d4.owner_blocks = 6, d4.chosen_blocks = 0;
    d4.cands[0] = (cand_spec){"A", "LIVE", 0, 0};
    d4.cands[1] = (cand_spec){"C", "LIVE", 3, 0};
    d4.cands[2] = (cand_spec){"B", "LIVE", 6, 0};
    d4.eligible[1] = F;
    /* D5: a record from before the field: the owner B (4) not chosen, A (1) chosen; 16 cached */
    decision_spec d5 = d1;
    d5.id = 5, d5.request = "r5", d5.time_ns = 50, d5.owner_blocks = 4, d5.chosen_blocks = 1;
    d5.cands[0] = (cand_spec){"A", "LIVE", 1, 0};
    d5.cands[1] = (cand_spec){"B", "LIVE", 4, 0};
    d5.eligible[0] = d5.eligible[1] = ELIGIBLE_ABSENT;
    d5.n_cands = 2;
    write_record(f, make_decision(&d1));                                     /* 1 */
    write_outcome_of(f, &d1, "complete", 200, 32, 5);                        /* 2 */
    write_record(f, make_decision(&d2));                                     /* 3 */
    outcome_spec o2 = outcome_for(&d2, "complete", 200, 80, 5);
    o2.dispatched = "A";
    write_record(f, make_outcome(&o2));                                      /* 4 */
    write_record(f, make_decision(&d3));                                     /* 5 */
    write_record(f, make_decision(&d4));                                     /* 6 */
    write_outcome_of(f, &d4, "complete", 200, -1, 5);                        /* 7 */
    write_record(f, make_decision(&d5));                                     /* 8 */
    write_outcome_of(f, &d5, "complete", 200, 16, 5);                        /* 9 */
    decision_spec bad = d1;
    bad.id = 6, bad.request = "r6";
    json_t *text_eligible = make_decision(&bad);
    json_object_set_new(json_array_get(json_object_get(text_eligible, "candidates"), 2), "eligible",
                        json_string("false"));
    write_record(f, text_eligible);                                          /* 10 invalid */
    json_t *null_eligible = make_decision(&bad);
    json_object_set_new(json_array_get(json_object_get(null_eligible, "candidates"), 0), "eligible",
                        json_null());
    write_record(f, null_eligible);                                          /* 11 invalid */
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.decisions, 5);
    EQ(s->input.invalid, 2);
    cr_assert_eq(s->n_invalid_lines, 2);
    EQ(s->invalid_lines[0].line, 10);
    cr_expect_str_eq(s->invalid_lines[0].what,
                     "decision record: field candidates[2].eligible: expected a boolean");
    EQ(s->invalid_lines[1].line, 11);
    cr_expect_str_eq(s->invalid_lines[1].what,
                     "decision record: field candidates[0].eligible: expected a boolean");

    const km_analysis_owner *o = &s->owner;
    EQ(o->owner_is_chosen, 1);
    EQ(o->owner_not_chosen, 4);
    /* D1 and D4: owners 8 + 6 blocks, chosen 2 + 0 */
    EQ(o->owner_ineligible.decisions, 2);
    EQ(o->owner_ineligible.owner_tokens, 224);
    EQ(o->owner_ineligible.chosen_tokens, 32);
    EQ(o->owner_ineligible.cost_tokens, 192);
    EQ(o->owner_ineligible.joined_known, 1); /* D1; D4's cached tokens are unknown */
    EQ(o->owner_ineligible.joined_actual_tokens, 32);
    EQ(o->owner_ineligible.joined_owner_tokens, 128);
    EQ(o->owner_ineligible.joined_overridden, 0);
    /* D2 and D5 (no field: eligible): owners 5 + 4 blocks, chosen 1 + 1 */
    EQ(o->owner_eligible.decisions, 2);
    EQ(o->owner_eligible.owner_tokens, 144);
    EQ(o->owner_eligible.chosen_tokens, 32);
    EQ(o->owner_eligible.cost_tokens, 112);
    EQ(o->owner_eligible.joined_known, 1); /* D5; D2 was overridden */
    EQ(o->owner_eligible.joined_actual_tokens, 16);
    EQ(o->owner_eligible.joined_owner_tokens, 64);
    EQ(o->owner_eligible.joined_overridden, 1);
    EQ(o->cost_tokens, 304);
    EQ(s->health.decisions_with_ineligible, 3);   /* D1, D2, D4 */
    EQ(s->health.ineligible_candidates, 4);       /* B in D1, D2, D4; C in D4 */

    cr_assert_eq(s->n_workers, 3);
    const char *names[3] = {"A", "B", "C"};
    uint64_t chosen[3] = {4, 0, 1}, ineligible[3] = {0, 3, 1}, owned[3] = {0, 2, 0};
    for (int w = 0; w < 3; w++) {
        cr_expect_str_eq(s->workers[w].worker, names[w]);
        EQ(s->workers[w].chosen, chosen[w]);
        EQ(s->workers[w].ineligible, ineligible[w]);
        EQ(s->workers[w].owned_ineligible, owned[w]);
    }

    json_t *root = json_report(a);
    json_t *owner = json_object_get(root, "owner");
    cr_expect_eq(json_count(owner, "owner_ineligible", "decisions"), 2);
    cr_expect_eq(json_count(owner, "owner_ineligible", "cost_tokens"), 192);
    cr_expect_eq(json_count(owner, "owner_ineligible", "joined_owner_tokens"), 128);
    cr_expect_eq(json_count(owner, "owner_eligible", "decisions"), 2);
    cr_expect_eq(json_count(owner, "owner_eligible", "cost_tokens"), 112);
    cr_expect_eq(json_count(owner, "owner_eligible", "joined_overridden"), 1);
    cr_expect_eq(json_count(root, "health", "decisions_with_ineligible"), 3);
    cr_expect_eq(json_count(root, "health", "ineligible_candidates"), 4);
    json_t *b = json_array_get(json_object_get(root, "workers"), 1);
    cr_expect_eq(json_count(b, NULL, "ineligible"), 3);
    cr_expect_eq(json_count(b, NULL, "owned_ineligible"), 2);
    json_decref(root);

    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
    const char *t = km_text_cstr(&text);
    cr_expect(strstr(t, "worker the policy could not choose): 2 decisions, owners held 224 tokens, "
                        "the chosen 32: 192 tokens of predicted reuse given up; 1 joined and "
                        "served by the chosen worker: actual 32 vs the owners' predicted 128 (0 "
                        "overridden, left out)"), "%s", t);
    cr_expect(strstr(t, "owner eligible (the policy chose another eligible worker): 2 decisions, "
                        "owners held 144 tokens, the chosen 32: 112 tokens"), "%s", t);
    cr_expect(strstr(t, "decisions with an ineligible candidate 3 (60.0%), ineligible candidates "
                        "4; owner ineligible 2"), "%s", t);
    cr_expect(strstr(t, "p/B: chosen 0 (0.0%), in_flight mean 0.00 max 0, ineligible in 3 (owner "
                        "while ineligible 2)\n"), "%s", t);
    cr_expect(strstr(t, "p/A: chosen 4 (80.0%), in_flight mean 0.00 max 0, sent here by router "
                        "override 1\n"), "%s", t);
    cr_expect(strstr(t, "p/C: chosen 1 (20.0%), in_flight mean 0.00 max 0, ineligible in 1 (owner "
                        "while ineligible 0)\n"), "%s", t);
    km_text_free(&text);

    km_text page;
    km_text_init(&page, 0);
    cr_assert_eq(km_analysis_render_html(a, &page), KM_OK);
    const char *h = km_text_cstr(&page);
    cr_expect(strstr(h, "eligible, another eligible worker chosen</td><td>2 (192 tokens given up) / "
                        "2 (112 tokens given up)</td></tr>"), "%s", h);
    cr_expect(strstr(h, "<tr><td>decisions with an ineligible candidate</td><td>3</td></tr>"),
              "%s", h);
    km_text_free(&page);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* json_object_get, counted: the analysis looks every field up through it, so the calls it makes
 * while reading a record measure its work on that record without a clock. Counted on the thread
 * that set counting_lookups; every other call goes straight to jansson's. */
static _Thread_local int counting_lookups;
static _Thread_local uint64_t lookups;
static json_t *(*jansson_object_get)(const json_t *, const char *);

/* Resolved before main, so that no two threads race to resolve it. */
__attribute__((constructor)) static void find_jansson_object_get(void)
{
    *(void **)&jansson_object_get = dlsym(RTLD_NEXT, "json_object_get");
}

json_t *json_object_get(const json_t *object, const char *key)
{
    if (!jansson_object_get)
        abort(); /* a broken test build: jansson is not linked dynamically */
    lookups += (uint64_t)counting_lookups;
    return jansson_object_get(object, key);
}

Test(analyze, ineligible_candidates_are_counted_in_one_pass, .timeout = 30)
{
    enum { N = 3000 };
    char dir[64], path[128];
    make_temp_dir(dir);
    /* one decision: w0 (chosen, eligible), then N-1 distinct ineligible workers, then w0 again
     * ineligible (judged by its first row: eligible) and w1 again (counted once) */
    json_t *cands = json_array();
    for (int i = 0; i <= N; i++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", i < N ? i : 0);
        json_array_append_new(
            cands, json_pack("{ss ss sI sI si sb}", "worker", name, "state", "LIVE",
                             "depth_blocks", (json_int_t)0, "depth_tokens", (json_int_t)0,
                             "in_flight", 0, "eligible", i == 0));
    }
    json_array_append_new(cands, json_pack("{ss ss sI sI si sb}", "worker", "w1", "state", "LIVE",
                                           "depth_blocks", (json_int_t)0, "depth_tokens",
                                           (json_int_t)0, "in_flight", 0, "eligible", 0));
    size_t rows = json_array_size(cands);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 100,
                       .owner = "w2", .owner_state = "LIVE", .owner_blocks = 0, .chosen = "w0",
                       .chosen_state = "LIVE", .chosen_blocks = 0, .policy = "kv"};
    json_t *record = make_decision(&d);
    json_object_set_new(record, "candidates", cands);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    write_record(f, record);
    fclose(f);

    km_analysis *a = NULL;
    cr_assert_eq(km_analysis_create(NULL, &a), KM_OK);
    lookups = 0;
    counting_lookups = 1;
    int rc = km_analysis_add_file(a, path);
    counting_lookups = 0;
    cr_assert_eq(rc, KM_OK, "%s", km_analysis_last_error(a));
    /* a fixed number of lookups per row; a pass over the earlier rows for each ineligible one
     * would take about rows^2 / 2 (4.5 million) */
    cr_expect_lt(lookups, 20 * (uint64_t)rows, "%" PRIu64 " field lookups for %zu rows", lookups,
                 rows);
    cr_assert_eq(km_analysis_finish(a), KM_OK, "%s", km_analysis_last_error(a));
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.decisions, 1);
    EQ(s->health.decisions_with_ineligible, 1);
    EQ(s->health.ineligible_candidates, N - 1);
    uint64_t total = 0, owned = 0;
    for (size_t w = 0; w < s->n_workers; w++) {
        cr_expect(s->workers[w].ineligible == (strcmp(s->workers[w].worker, "w0") ? 1u : 0u),
                  "%s: ineligible in %" PRIu64, s->workers[w].worker, s->workers[w].ineligible);
        total += s->workers[w].ineligible;
        owned += s->workers[w].owned_ineligible;
    }
    EQ(s->n_workers, N);
    EQ(total, N - 1);
    EQ(owned, 1); /* w2 */
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* ---- random records against a brute-force model ------------------------------------------------- */

static const char *const rand_workers[5] = {"W0", "W1", "W2", "W3", "W4"};
static const char *const rand_bad_states[3] = {"GAP", "SYNCING", "DEGRADED"};
static const char *const rand_kinds[5] = {"complete", "incomplete", "error", "cancelled", "expired"};

typedef struct rand_decision {
    decision_spec spec;
    char request[24];
    int outcome_mode; /* 0: none, 1: same (instance, decision_id), 2: other ids, same request */
    outcome_spec outcome;
    int decision_file, outcome_file;
} rand_decision;

/* The brute-force difference bucket: thresholds written out. */
static uint32_t model_bucket(int64_t d)
{
    static const int64_t upper[KM_ANALYSIS_DIFF_BUCKETS - 1] = {-4096, -1024, -256, -64, -16, -1, 0,
                                                                15,    63,    255,  1023, 4095};
    for (uint32_t b = 0; b < KM_ANALYSIS_DIFF_BUCKETS - 1; b++)
        if (d <= upper[b])
            return b;
    return KM_ANALYSIS_DIFF_BUCKETS - 1;
}

typedef struct model_window {
    const char *instance, *pool, *worker, *state;
    int64_t start, end;
    int open;
    uint64_t inside;
} model_window;

static int compare_model_windows(const void *x, const void *y)
{
    const model_window *p = x, *q = y;
    int c = strcmp(p->instance, q->instance);
    if (!c)
        c = strcmp(p->pool, q->pool);
    if (!c)
        c = strcmp(p->worker, q->worker);
    if (!c && p->start != q->start)
        c = p->start < q->start ? -1 : 1;
    return c;
}

static int compare_i64s(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return a < b ? -1 : a > b;
}

/* The model of an override: the outcome names a dispatched worker other than its worker. */
static int model_overridden(const outcome_spec *o)
{
    return o->dispatched && strcmp(o->dispatched, o->worker) != 0;
}

/* The model's prediction for outcome o of decision d (NULL: an outcome without decision): the
 * chosen worker's blocks (the outcome's copy without a decision), or for an override the blocks of
 * the decision's candidate row naming the dispatched worker, in tokens. 0 when an override has no
 * such row or no decision: not compared. */
static int model_prediction(const decision_spec *d, const outcome_spec *o, int64_t *predicted)
{
    if (!model_overridden(o)) {
        *predicted = (d ? d->chosen_blocks : o->predicted_blocks) * BLOCK;
        return 1;
    }
    for (int c = 0; d && c < d->n_cands; c++)
        if (!strcmp(d->cands[c].worker, o->dispatched)) {
            *predicted = d->cands[c].depth_blocks * BLOCK;
            return 1;
        }
    return 0;
}

/* The model's quality over one more decision. */
static void model_quality_add(km_analysis_quality *q, const rand_decision *r)
{
    const decision_spec *s = &r->spec;
    q->decisions++;
    q->owner_not_chosen += s->owner && strcmp(s->owner, s->chosen);
    if (!strcmp(s->source, "events"))
        q->stale += strcmp(s->chosen_state, "LIVE") || (s->owner && strcmp(s->owner_state, "LIVE"));
    int64_t predicted;
    if (!r->outcome_mode || r->outcome.cached < 0)
        return;
    if (!model_prediction(s, &r->outcome, &predicted)) {
        q->overridden_unpredicted++;
        return;
    }
    q->known++;
    q->overridden += model_overridden(&r->outcome);
    q->predicted_tokens += (uint64_t)predicted;
    q->actual_tokens += (uint64_t)r->outcome.cached;
    q->exact += r->outcome.cached == predicted;
    if (s->prompt >= 0) {
        q->prompt_tokens += (uint64_t)s->prompt;
        q->actual_with_prompt += (uint64_t)r->outcome.cached;
    }
}

/* The model's per-worker counts, by host ("h1" or null), pool ("p0", "p1") and worker. */
typedef struct model_worker {
    uint64_t chosen, dispatched_by_override, ineligible, owned_ineligible;
} model_worker;

static model_worker *model_worker_of(model_worker table[2][2][5], const char *host,
                                     const char *pool, const char *worker)
{
    int w = 0;
    while (strcmp(rand_workers[w], worker))
        w++;
    return &table[host ? 0 : 1][strcmp(pool, "p0") ? 1 : 0][w];
}

Test(analyze, random_records_match_brute_force, .timeout = 120)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    char dir[64];
    make_temp_dir(dir);
    uint64_t overrides_compared = 0, overrides_unpredicted = 0, overrides_to_owner = 0;
    km_analysis_owner health_seen = {0}; /* the owner split's figures summed over the rounds */
    for (int round = 0; round < 4; round++) {
        size_t n = 50 + km_rng_below(&rng, 700);
        size_t n_orphans = km_rng_below(&rng, (uint32_t)(n / 8 + 1));
        rand_decision *d = calloc(n, sizeof *d);
        outcome_spec *orphans = calloc(n_orphans + 1, sizeof *orphans);
        char (*orphan_requests)[24] = calloc(n_orphans + 1, 24);
        int orphan_files[256];
        cr_assert(d && orphans && orphan_requests);
        /* each instance's decisions go to its own rotated files in sequence (as the writer does);
         * outcomes and orphans go anywhere */
        enum { n_files = 6 };
        uint32_t cuts[2][2];
        for (int k = 0; k < 2; k++) {
            cuts[k][0] = km_rng_below(&rng, (uint32_t)n + 1);
            cuts[k][1] = cuts[k][0] + km_rng_below(&rng, (uint32_t)n + 1 - cuts[k][0]);
        }
        for (size_t i = 0; i < n; i++) {
            rand_decision *r = &d[i];
            decision_spec *s = &r->spec;
            snprintf(r->request, sizeof r->request, "q%zu", i);
            int approx = km_rng_percent(&rng, 15);
            int instance_b = (int)km_rng_below(&rng, 2);
            *s = (decision_spec){.instance = instance_b ? "iB" : "iA",
                                 .id = (int64_t)i,
                                 .request = r->request,
                                 .attempt = km_rng_below(&rng, 2) ? "0" : "1",
                                 .host = instance_b ? NULL : "h1", /* an instance's host */
                                 .pool = km_rng_below(&rng, 2) ? "p0" : "p1",
                                 .time_ns = (int64_t)(i + 1) * 1000,
                                 .source = approx ? "approx" : "events",
                                 .prompt = km_rng_percent(&rng, 10) ? -1 : (int64_t)(320 + km_rng_below(&rng, 700)),
                                 .policy = km_rng_below(&rng, 2) ? "kv" : "least_load"};
            for (int w = 0; w < 5; w++) {
                if (!km_rng_percent(&rng, 60) && !(w == 4 && s->n_cands == 0))
                    continue;
                const char *state = approx ? "APPROX"
                                    : km_rng_percent(&rng, 70) ? "LIVE"
                                                               : rand_bad_states[km_rng_below(&rng, 3)];
                s->cands[s->n_cands++] =
                    (cand_spec){rand_workers[w], state, km_rng_below(&rng, 21),
                                km_rng_percent(&rng, 10) ? -1 : (int64_t)km_rng_below(&rng, 11)};
            }
            /* worker health: a record from before the field (no `eligible`: all eligible), or
             * each row ineligible at 30%, at least one eligible, the ineligible ones last (as the
             * server writes them) */
            int n_eligible = s->n_cands;
            if (km_rng_percent(&rng, 75)) {
                int ineligible[8], n_ineligible = 0;
                for (int c = 0; c < s->n_cands; c++)
                    n_ineligible += ineligible[c] = km_rng_percent(&rng, 30);
                if (n_ineligible == s->n_cands) {
                    ineligible[km_rng_below(&rng, (uint32_t)s->n_cands)] = 0;
                    n_ineligible--;
                }
                cand_spec rows[8];
                int n_rows = 0;
                for (int pass = 0; pass < 2; pass++)
                    for (int c = 0; c < s->n_cands; c++)
                        if (ineligible[c] == pass) {
                            s->eligible[n_rows] = pass ? ELIGIBLE_FALSE : ELIGIBLE_TRUE;
                            rows[n_rows++] = s->cands[c];
                        }
                memcpy(s->cands, rows, sizeof rows[0] * (size_t)n_rows);
                n_eligible = s->n_cands - n_ineligible;
            }
            /* the policy's reason, and eligible rows the policy left out (cost null) */
            static const char *const reasons[3] = {"min_cost", "spread", "sampled"};
            uint32_t pick = km_rng_below(&rng, 4);
            s->null_reason = pick == 3;
            s->reason = pick < 3 ? reasons[pick] : NULL;
            for (int c = 0; c < n_eligible; c++)
                s->unweighed[c] = km_rng_percent(&rng, 25);
            /* the chosen one is eligible; an ineligible owner holds strictly more than every
             * eligible row (the first deepest row below) */
            const cand_spec *chosen = &s->cands[km_rng_below(&rng, (uint32_t)n_eligible)];
            s->chosen = chosen->worker, s->chosen_state = chosen->state,
            s->chosen_blocks = chosen->depth_blocks;
            const cand_spec *owner = NULL;
            for (int c = 0; c < s->n_cands; c++)
                if (s->cands[c].depth_blocks > 0 &&
                    (!owner || s->cands[c].depth_blocks > owner->depth_blocks))
                    owner = &s->cands[c];
            if (owner)
                s->owner = owner->worker, s->owner_state = owner->state,
                s->owner_blocks = owner->depth_blocks;
            uint32_t mode = km_rng_below(&rng, 100);
            r->outcome_mode = mode < 70 ? 1 : mode < 80 ? 2 : 0;
            int64_t http[3] = {200, 500, -1};
            r->outcome = outcome_for(s, rand_kinds[km_rng_below(&rng, 5)], http[km_rng_below(&rng, 3)],
                                     km_rng_percent(&rng, 20) ? -1 : (int64_t)km_rng_below(&rng, 401),
                                     km_rng_percent(&rng, 50) ? -1 : (int64_t)(1 + km_rng_below(&rng, 1000000)));
            if (r->outcome_mode == 2)
                r->outcome.instance = "iX", r->outcome.id = 100000 + (int64_t)i;
            /* a router override to any worker: a candidate of the decision or not, now and then the
             * chosen one named again (no override) */
            if (km_rng_percent(&rng, 30))
                r->outcome.dispatched = rand_workers[km_rng_below(&rng, 5)];
            int inst = s->instance[1] == 'B';
            r->decision_file = inst * 3 + (i < cuts[inst][0] ? 0 : i < cuts[inst][1] ? 1 : 2);
            r->outcome_file = (int)km_rng_below(&rng, n_files);
        }
        for (size_t k = 0; k < n_orphans && k < 256; k++) {
            snprintf(orphan_requests[k], 24, "orphan%zu", k);
            orphans[k] = outcome_for(&d[km_rng_below(&rng, (uint32_t)n)].spec,
                                     rand_kinds[km_rng_below(&rng, 5)], 200,
                                     km_rng_percent(&rng, 20) ? -1 : (int64_t)km_rng_below(&rng, 401),
                                     km_rng_below(&rng, 1000));
            orphans[k].id = 200000 + (int64_t)k;
            orphans[k].instance = "iA";
            orphans[k].request = orphan_requests[k];
            orphans[k].predicted_blocks = km_rng_below(&rng, 30);
            if (km_rng_percent(&rng, 30))
                orphans[k].dispatched = rand_workers[km_rng_below(&rng, 5)];
            orphan_files[k] = (int)km_rng_below(&rng, n_files);
        }
        if (n_orphans > 256)
            n_orphans = 256;

        /* write: each file in time order */
        char paths[n_files][128];
        FILE *files[n_files];
        for (int k = 0; k < n_files; k++) {
            char name[32];
            snprintf(name, sizeof name, "rand%d-%d.jsonl", round, k);
            files[k] = open_in(dir, name, paths[k], sizeof paths[k]);
        }
        for (size_t i = 0; i < n; i++) {
            write_record(files[d[i].decision_file], make_decision(&d[i].spec));
            if (d[i].outcome_mode)
                write_record(files[d[i].outcome_file], make_outcome(&d[i].outcome));
        }
        for (size_t k = 0; k < n_orphans; k++)
            write_record(files[orphan_files[k]], make_outcome(&orphans[k]));
        for (int k = 0; k < n_files; k++)
            fclose(files[k]);

        /* the model */
        km_analysis_summary m;
        memset(&m, 0, sizeof m);
        int64_t *ttfts = calloc(n + n_orphans + 1, sizeof *ttfts);
        size_t n_ttft = 0;
        model_window *windows = calloc(n * 5 + 1, sizeof *windows);
        size_t n_windows = 0;
        cr_assert(ttfts && windows);
        model_worker workers[2][2][5];
        km_analysis_quality policy_quality[2]; /* kv, least_load */
        km_analysis_quality in_quality, out_quality;
        memset(workers, 0, sizeof workers);
        memset(policy_quality, 0, sizeof policy_quality);
        memset(&in_quality, 0, sizeof in_quality);
        memset(&out_quality, 0, sizeof out_quality);
        for (size_t i = 0; i < n + n_orphans; i++) {
            const outcome_spec *o;
            const decision_spec *decision;
            int64_t predicted;
            if (i < n) {
                const rand_decision *r = &d[i];
                const decision_spec *s = &r->spec;
                int events = !strcmp(s->source, "events");
                /* health: the rows written eligible false, the owner's among them */
                int owner_ineligible = 0, any_ineligible = 0;
                for (int c = 0; c < s->n_cands; c++) {
                    if (s->eligible[c] != ELIGIBLE_FALSE)
                        continue;
                    int owned = s->owner && !strcmp(s->cands[c].worker, s->owner);
                    model_worker *mw = model_worker_of(workers, s->host, s->pool, s->cands[c].worker);
                    mw->ineligible++;
                    mw->owned_ineligible += (uint64_t)owned;
                    owner_ineligible |= owned;
                    any_ineligible = 1;
                    m.health.ineligible_candidates++;
                }
                m.health.decisions_with_ineligible += (uint64_t)any_ineligible;
                m.owner.decisions++;
                if (!s->owner)
                    m.owner.no_owner++;
                else if (strcmp(s->owner, s->chosen)) {
                    km_analysis_owner_part *part =
                        owner_ineligible ? &m.owner.owner_ineligible : &m.owner.owner_eligible;
                    m.owner.owner_not_chosen++;
                    m.owner.owner_tokens += (uint64_t)s->owner_blocks * BLOCK;
                    m.owner.chosen_tokens += (uint64_t)s->chosen_blocks * BLOCK;
                    part->decisions++;
                    part->owner_tokens += (uint64_t)s->owner_blocks * BLOCK;
                    part->chosen_tokens += (uint64_t)s->chosen_blocks * BLOCK;
                    part->cost_tokens += (uint64_t)(s->owner_blocks - s->chosen_blocks) * BLOCK;
                    int joined_known = r->outcome_mode && r->outcome.cached >= 0;
                    if (joined_known && model_overridden(&r->outcome)) {
                        m.owner.joined_overridden++;
                        part->joined_overridden++;
                    } else if (joined_known) {
                        m.owner.joined_known++;
                        m.owner.joined_actual_tokens += (uint64_t)r->outcome.cached;
                        m.owner.joined_owner_tokens += (uint64_t)s->owner_blocks * BLOCK;
                        part->joined_known++;
                        part->joined_actual_tokens += (uint64_t)r->outcome.cached;
                        part->joined_owner_tokens += (uint64_t)s->owner_blocks * BLOCK;
                    }
                } else
                    m.owner.owner_is_chosen++;
                if (r->outcome_mode && model_overridden(&r->outcome)) {
                    m.owner.overridden++;
                    m.owner.overridden_to_owner +=
                        s->owner && !strcmp(s->owner, r->outcome.dispatched);
                }
                model_worker_of(workers, s->host, s->pool, s->chosen)->chosen++;
                model_quality_add(&policy_quality[strcmp(s->policy, "kv") ? 1 : 0], r);
                if (events) {
                    m.staleness.events_decisions++;
                    int chosen_bad = strcmp(s->chosen_state, "LIVE") != 0;
                    int owner_bad = s->owner && strcmp(s->owner_state, "LIVE") != 0;
                    m.staleness.chosen_not_live += (uint64_t)chosen_bad;
                    m.staleness.owner_not_live += (uint64_t)owner_bad;
                    m.staleness.stale_decisions += (uint64_t)(chosen_bad || owner_bad);
                } else
                    m.staleness.approx_decisions++;
                if (r->outcome_mode == 1)
                    m.join.by_decision_id++;
                else if (r->outcome_mode == 2)
                    m.join.by_request++;
                else {
                    m.join.decisions_without_outcome++;
                    continue;
                }
                o = &r->outcome;
                decision = s;
            } else {
                o = &orphans[i - n];
                decision = NULL;
                m.join.outcomes_without_decision++;
            }
            if (model_overridden(o))
                model_worker_of(workers, decision ? decision->host : o->host, o->pool,
                                o->dispatched)->dispatched_by_override++;
            m.reuse.outcomes++;
            if (o->cached < 0) {
                m.reuse.unknown++;
            } else if (!model_prediction(decision, o, &predicted)) {
                m.reuse.overridden_unpredicted++;
            } else {
                m.reuse.known++;
                m.reuse.overridden += model_overridden(o);
                m.reuse.from_outcome_copy += i >= n;
                m.reuse.predicted_tokens += (uint64_t)predicted;
                m.reuse.actual_tokens += (uint64_t)o->cached;
                int64_t diff = o->cached - predicted;
                if (diff == 0)
                    m.reuse.exact++;
                else if (diff < 0)
                    m.reuse.over_predicted++, m.reuse.over_predicted_tokens += (uint64_t)-diff;
                else
                    m.reuse.under_predicted++, m.reuse.under_predicted_tokens += (uint64_t)diff;
                m.reuse.difference_buckets[model_bucket(diff)]++;
            }
            int kind = 0;
            while (strcmp(rand_kinds[kind], o->outcome))
                kind++;
            uint64_t *kinds[5] = {&m.outcomes.complete, &m.outcomes.incomplete, &m.outcomes.error,
                                  &m.outcomes.cancelled, &m.outcomes.expired};
            (*kinds[kind])++;
            if (kind == 1 && o->http_status == 200)
                m.outcomes.incomplete_http_200++;
            if (kind == 0 && o->ttft_ns >= 0)
                ttfts[n_ttft++] = o->ttft_ns;
        }
        /* windows: every (instance, pool, worker) stream in time order, without compression */
        const char *instances[2] = {"iA", "iB"}, *pools[2] = {"p0", "p1"};
        for (int ii = 0; ii < 2; ii++)
            for (int pi = 0; pi < 2; pi++)
                for (int w = 0; w < 5; w++) {
                    int open = 0;
                    model_window cur = {0};
                    for (size_t i = 0; i < n; i++) {
                        const decision_spec *s = &d[i].spec;
                        if (strcmp(s->instance, instances[ii]) || strcmp(s->pool, pools[pi]) ||
                            strcmp(s->source, "events"))
                            continue;
                        const char *state = NULL;
                        for (int c = 0; c < s->n_cands; c++)
                            if (!strcmp(s->cands[c].worker, rand_workers[w]))
                                state = s->cands[c].state;
                        if (!state)
                            continue;
                        if (strcmp(state, "LIVE")) {
                            if (!open)
                                cur = (model_window){instances[ii], pools[pi], rand_workers[w],
                                                     state, s->time_ns, s->time_ns, 0, 0};
                            open = 1;
                            cur.end = s->time_ns;
                        } else if (open) {
                            cur.end = s->time_ns;
                            windows[n_windows++] = cur;
                            open = 0;
                        }
                    }
                    if (open)
                        cur.open = 1, windows[n_windows++] = cur;
                }
        qsort(windows, n_windows, sizeof *windows, compare_model_windows);
        uint64_t in_windows = 0;
        for (size_t i = 0; i < n; i++) {
            const decision_spec *s = &d[i].spec;
            int inside = 0;
            for (size_t k = 0; k < n_windows; k++) {
                model_window *w = &windows[k];
                if (strcmp(w->instance, s->instance) || strcmp(w->pool, s->pool))
                    continue;
                if (s->time_ns >= w->start && (w->open ? s->time_ns <= w->end : s->time_ns < w->end))
                    w->inside++, inside = 1;
            }
            in_windows += (uint64_t)inside;
            model_quality_add(inside ? &in_quality : &out_quality, &d[i]);
        }

        /* the analysis, files in a random order */
        const char *order[n_files];
        for (int k = 0; k < n_files; k++)
            order[k] = paths[k];
        for (int k = n_files - 1; k > 0; k--) {
            int j = (int)km_rng_below(&rng, (uint32_t)k + 1);
            const char *t = order[k];
            order[k] = order[j];
            order[j] = t;
        }
        km_analysis *a = analyze_files(NULL, order, n_files);
        const km_analysis_summary *s = km_analysis_summary_get(a);
#define SAME(field) KM_CHECK(s->field == m.field, "round %d: %s = %" PRIu64 ", model %" PRIu64, round, \
                             #field, (uint64_t)s->field, (uint64_t)m.field)
        KM_CHECK(s->input.decisions == n, "decisions %" PRIu64, s->input.decisions);
        KM_CHECK(s->input.outcomes == m.reuse.outcomes, "outcomes %" PRIu64, s->input.outcomes);
        KM_CHECK(s->input.invalid == 0, "invalid %" PRIu64, s->input.invalid);
        KM_CHECK(s->input.interleaved_streams == 0, "interleaved %" PRIu64,
                 s->input.interleaved_streams);
        SAME(join.by_decision_id);
        SAME(join.by_request);
        SAME(join.decisions_without_outcome);
        SAME(join.outcomes_without_decision);
        SAME(join.copy_mismatches);
        SAME(reuse.outcomes);
        SAME(reuse.unknown);
        SAME(reuse.known);
        SAME(reuse.overridden_unpredicted);
        SAME(reuse.overridden);
        SAME(reuse.from_outcome_copy);
        SAME(reuse.predicted_tokens);
        SAME(reuse.actual_tokens);
        SAME(reuse.exact);
        SAME(reuse.over_predicted);
        SAME(reuse.under_predicted);
        SAME(reuse.over_predicted_tokens);
        SAME(reuse.under_predicted_tokens);
        for (int b = 0; b < KM_ANALYSIS_DIFF_BUCKETS; b++)
            SAME(reuse.difference_buckets[b]);
        SAME(owner.decisions);
        SAME(owner.no_owner);
        SAME(owner.owner_is_chosen);
        SAME(owner.owner_not_chosen);
        SAME(owner.owner_tokens);
        SAME(owner.chosen_tokens);
        SAME(owner.joined_known);
        SAME(owner.joined_actual_tokens);
        SAME(owner.joined_owner_tokens);
        SAME(owner.joined_overridden);
        SAME(owner.overridden);
        SAME(owner.overridden_to_owner);
#define SAME_PART(part)                                                                            \
    do {                                                                                           \
        SAME(owner.part.decisions);                                                                \
        SAME(owner.part.owner_tokens);                                                             \
        SAME(owner.part.chosen_tokens);                                                            \
        SAME(owner.part.cost_tokens);                                                              \
        SAME(owner.part.joined_known);                                                             \
        SAME(owner.part.joined_actual_tokens);                                                     \
        SAME(owner.part.joined_owner_tokens);                                                      \
        SAME(owner.part.joined_overridden);                                                        \
    } while (0)
        SAME_PART(owner_ineligible);
        SAME_PART(owner_eligible);
#undef SAME_PART
        SAME(health.decisions_with_ineligible);
        SAME(health.ineligible_candidates);
        SAME(staleness.events_decisions);
        SAME(staleness.chosen_not_live);
        SAME(staleness.owner_not_live);
        SAME(staleness.stale_decisions);
        SAME(staleness.approx_decisions);
        SAME(outcomes.complete);
        SAME(outcomes.incomplete);
        SAME(outcomes.incomplete_http_200);
        SAME(outcomes.error);
        SAME(outcomes.cancelled);
        SAME(outcomes.expired);
        qsort(ttfts, n_ttft, sizeof *ttfts, compare_i64s);
        KM_CHECK(s->outcomes.ttft_known == n_ttft, "ttft_known");
        if (n_ttft) {
            size_t r50 = (n_ttft + 1) / 2, r99 = (n_ttft * 99 + 99) / 100; /* nearest rank */
            KM_CHECK(s->outcomes.ttft_p50_ms == (double)ttfts[r50 - 1] / 1e6, "p50 %f vs %f",
                     s->outcomes.ttft_p50_ms, (double)ttfts[r50 - 1] / 1e6);
            KM_CHECK(s->outcomes.ttft_p99_ms == (double)ttfts[r99 - 1] / 1e6, "p99");
        }
        KM_CHECK(s->n_windows == n_windows, "round %d: %zu windows, model %zu", round, s->n_windows,
                 n_windows);
        for (size_t k = 0; k < n_windows; k++) {
            const km_analysis_window *w = &s->windows[k];
            const model_window *e = &windows[k];
            KM_CHECK(!strcmp(w->instance, e->instance) && !strcmp(w->pool, e->pool) &&
                         !strcmp(w->worker, e->worker) && !strcmp(w->state, e->state) &&
                         w->start_ns == e->start && w->end_ns == e->end && w->open == e->open &&
                         w->inside.decisions == e->inside,
                     "window %zu: %s/%s/%s %s [%" PRId64 ", %" PRId64 "] open %d inside %" PRIu64
                     "; model %s/%s/%s %s [%" PRId64 ", %" PRId64 "] open %d inside %" PRIu64,
                     k, w->instance, w->pool, w->worker, w->state, w->start_ns, w->end_ns, w->open,
                     w->inside.decisions, e->instance, e->pool, e->worker, e->state, e->start,
                     e->end, e->open, e->inside);
        }
        KM_CHECK(s->in_windows.decisions == in_windows, "in windows %" PRIu64 ", model %" PRIu64,
                 s->in_windows.decisions, in_windows);
        KM_CHECK(s->in_windows.decisions + s->outside_windows.decisions == n, "in + out");
        uint64_t policy_total = 0;
        for (size_t k = 0; k < s->n_policies; k++)
            policy_total += s->policies[k].quality.decisions;
        KM_CHECK(policy_total == n, "per-policy decisions add up");
#define SAME_QUALITY(actual, model, field)                                                         \
    KM_CHECK((actual).field == (model).field, "round %d: %s.%s = %" PRIu64 ", model %" PRIu64,    \
             round, #actual, #field, (uint64_t)(actual).field, (uint64_t)(model).field)
#define SAME_QUALITIES(actual, model)                                                              \
    do {                                                                                           \
        SAME_QUALITY(actual, model, decisions);                                                    \
        SAME_QUALITY(actual, model, owner_not_chosen);                                             \
        SAME_QUALITY(actual, model, stale);                                                        \
        SAME_QUALITY(actual, model, known);                                                        \
        SAME_QUALITY(actual, model, overridden);                                                   \
        SAME_QUALITY(actual, model, overridden_unpredicted);                                       \
        SAME_QUALITY(actual, model, predicted_tokens);                                             \
        SAME_QUALITY(actual, model, actual_tokens);                                                \
        SAME_QUALITY(actual, model, exact);                                                        \
        SAME_QUALITY(actual, model, prompt_tokens);                                                \
        SAME_QUALITY(actual, model, actual_with_prompt);                                           \
    } while (0)
        SAME_QUALITIES(s->in_windows, in_quality);
        SAME_QUALITIES(s->outside_windows, out_quality);
        for (size_t k = 0; k < s->n_policies; k++)
            SAME_QUALITIES(s->policies[k].quality,
                           policy_quality[strcmp(s->policies[k].policy, "kv") ? 1 : 0]);
#undef SAME_QUALITIES
#undef SAME_QUALITY
        /* decisions by (policy, reason) */
        {
            km_analysis_reason model_reasons[2][4];
            memset(model_reasons, 0, sizeof model_reasons);
            for (size_t i = 0; i < n; i++) {
                const decision_spec *ds = &d[i].spec;
                int pol = strcmp(ds->policy, "kv") ? 1 : 0;
                int why = ds->null_reason ? 3 : !strcmp(ds->reason, "min_cost") ? 0
                                            : !strcmp(ds->reason, "spread")     ? 1
                                                                                : 2;
                km_analysis_reason *e = &model_reasons[pol][why];
                e->decisions++;
                if (!ds->owner || !strcmp(ds->owner, ds->chosen))
                    continue;
                e->owner_not_chosen++;
                int owner_unweighed = 0, chosen_weighed = 0;
                for (int c = 0; c < ds->n_cands; c++) {
                    int weighed = ds->eligible[c] != ELIGIBLE_FALSE && !ds->unweighed[c];
                    if (!strcmp(ds->cands[c].worker, ds->owner))
                        owner_unweighed = ds->eligible[c] != ELIGIBLE_FALSE && ds->unweighed[c];
                    if (!strcmp(ds->cands[c].worker, ds->chosen))
                        chosen_weighed = weighed;
                }
                e->owner_not_weighed += owner_unweighed && chosen_weighed;
                if (ds->owner_blocks > ds->chosen_blocks)
                    e->given_up_tokens += (uint64_t)(ds->owner_blocks - ds->chosen_blocks) * BLOCK;
            }
            size_t model_rows = 0;
            for (int pol = 0; pol < 2; pol++)
                for (int why = 0; why < 4; why++)
                    model_rows += model_reasons[pol][why].decisions > 0;
            KM_CHECK(s->n_reasons == model_rows, "round %d: %zu reason rows, model %zu", round,
                     s->n_reasons, model_rows);
            for (size_t k = 0; k < s->n_reasons; k++) {
                const km_analysis_reason *got = &s->reasons[k];
                int pol = strcmp(got->policy, "kv") ? 1 : 0;
                int why = !*got->reason                   ? 3
                          : !strcmp(got->reason, "min_cost") ? 0
                          : !strcmp(got->reason, "spread")   ? 1
                                                             : 2;
                const km_analysis_reason *e = &model_reasons[pol][why];
                KM_CHECK(got->decisions == e->decisions &&
                             got->owner_not_chosen == e->owner_not_chosen &&
                             got->owner_not_weighed == e->owner_not_weighed &&
                             got->given_up_tokens == e->given_up_tokens,
                         "round %d: %s / %s: %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                         ", model %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64,
                         round, got->policy, got->reason, got->decisions, got->owner_not_chosen,
                         got->owner_not_weighed, got->given_up_tokens, e->decisions,
                         e->owner_not_chosen, e->owner_not_weighed, e->given_up_tokens);
                KM_CHECK(k == 0 || strcmp(s->reasons[k - 1].policy, got->policy) < 0 ||
                             (!strcmp(s->reasons[k - 1].policy, got->policy) &&
                              strcmp(s->reasons[k - 1].reason, got->reason) < 0),
                         "round %d: reason rows out of order at %zu", round, k);
            }
        }
        /* per worker: every row against the model, and no row the model lacks a count for */
        uint64_t model_chosen = 0, model_dispatched = 0, rows_chosen = 0, rows_dispatched = 0;
        uint64_t model_ineligible = 0, model_owned = 0, rows_ineligible = 0, rows_owned = 0;
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 2; p++)
                for (int w = 0; w < 5; w++)
                    model_chosen += workers[h][p][w].chosen,
                        model_dispatched += workers[h][p][w].dispatched_by_override,
                        model_ineligible += workers[h][p][w].ineligible,
                        model_owned += workers[h][p][w].owned_ineligible;
        for (size_t k = 0; k < s->n_workers; k++) {
            const km_analysis_worker *w = &s->workers[k];
            const model_worker *e = model_worker_of(workers, *w->host ? w->host : NULL, w->pool,
                                                    w->worker);
            KM_CHECK(w->chosen == e->chosen &&
                         w->dispatched_by_override == e->dispatched_by_override,
                     "round %d: worker %s/%s/%s chosen %" PRIu64 " dispatched %" PRIu64
                     "; model %" PRIu64 " / %" PRIu64,
                     round, w->host, w->pool, w->worker, w->chosen, w->dispatched_by_override,
                     e->chosen, e->dispatched_by_override);
            KM_CHECK(w->ineligible == e->ineligible && w->owned_ineligible == e->owned_ineligible,
                     "round %d: worker %s/%s/%s ineligible %" PRIu64 " owned %" PRIu64
                     "; model %" PRIu64 " / %" PRIu64,
                     round, w->host, w->pool, w->worker, w->ineligible, w->owned_ineligible,
                     e->ineligible, e->owned_ineligible);
            KM_CHECK(w->chosen || w->dispatched_by_override || w->ineligible,
                     "round %d: an empty worker row", round);
            rows_chosen += w->chosen, rows_dispatched += w->dispatched_by_override;
            rows_ineligible += w->ineligible, rows_owned += w->owned_ineligible;
        }
        KM_CHECK(rows_chosen == model_chosen && rows_dispatched == model_dispatched &&
                     rows_ineligible == model_ineligible && rows_owned == model_owned,
                 "round %d: worker rows %" PRIu64 " / %" PRIu64 " / %" PRIu64 " / %" PRIu64
                 ", model %" PRIu64 " / %" PRIu64 " / %" PRIu64 " / %" PRIu64,
                 round, rows_chosen, rows_dispatched, rows_ineligible, rows_owned, model_chosen,
                 model_dispatched, model_ineligible, model_owned);
#undef SAME
        km_analysis_destroy(a);
        free(ttfts);
        free(windows);
        free(d);
        free(orphans);
        free(orphan_requests);
        overrides_compared += m.reuse.overridden;
        overrides_unpredicted += m.reuse.overridden_unpredicted;
        overrides_to_owner += m.owner.overridden_to_owner;
        health_seen.owner_ineligible.decisions += m.owner.owner_ineligible.decisions;
        health_seen.owner_ineligible.joined_known += m.owner.owner_ineligible.joined_known;
        health_seen.owner_ineligible.joined_overridden += m.owner.owner_ineligible.joined_overridden;
        health_seen.owner_eligible.decisions += m.owner.owner_eligible.decisions;
        health_seen.owner_eligible.joined_known += m.owner.owner_eligible.joined_known;
    }
    /* and every case of the owner split, joined or overridden */
    KM_CHECK(health_seen.owner_ineligible.decisions && health_seen.owner_ineligible.joined_known &&
                 health_seen.owner_ineligible.joined_overridden &&
                 health_seen.owner_eligible.decisions && health_seen.owner_eligible.joined_known,
             "owner ineligible %" PRIu64 " (joined %" PRIu64 ", overridden %" PRIu64
             "), eligible %" PRIu64 " (joined %" PRIu64 ")",
             health_seen.owner_ineligible.decisions, health_seen.owner_ineligible.joined_known,
             health_seen.owner_ineligible.joined_overridden, health_seen.owner_eligible.decisions,
             health_seen.owner_eligible.joined_known);
    /* the generator made every kind of override (the odds against are astronomical) */
    KM_CHECK(overrides_compared && overrides_unpredicted && overrides_to_owner,
             "overrides compared %" PRIu64 ", unpredicted %" PRIu64 ", to the owner %" PRIu64,
             overrides_compared, overrides_unpredicted, overrides_to_owner);
    remove_dir(dir);
}

Test(analyze, interleaved_files_of_one_instance_are_flagged, .timeout = 10)
{
    char dir[64], px[128], py[128];
    make_temp_dir(dir);
    FILE *fx = open_in(dir, "x.jsonl", px, sizeof px);
    FILE *fy = open_in(dir, "y.jsonl", py, sizeof py);
    char requests[6][8];
    for (int i = 1; i <= 5; i++) {
        snprintf(requests[i], sizeof requests[i], "r%d", i);
        const char *state = i % 2 ? "GAP" : "LIVE"; /* x: GAP at 1, 3, 5; y: LIVE at 2, 4 */
        decision_spec d = {.instance = "i", .id = i, .request = requests[i], .attempt = "0",
                           .host = "h", .pool = "p", .time_ns = i * SEC, .source = "events",
                           .prompt = 10, .chosen = "A", .chosen_state = state, .policy = "kv",
                           .cands = {{"A", state, 0, 1}}, .n_cands = 1};
        write_record(i % 2 ? fx : fy, make_decision(&d));
    }
    fclose(fx);
    fclose(fy);
    const char *paths[] = {px, py};
    km_analysis *a = analyze_files(NULL, paths, 2);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.interleaved_streams, 1);
    km_text t;
    km_text_init(&t, 0);
    cr_assert_eq(km_analysis_render_text(a, &t), KM_OK);
    cr_expect(strstr(km_text_cstr(&t), "recovery windows may be inexact"), "%s", km_text_cstr(&t));
    km_text_free(&t);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* ---- HTML -------------------------------------------------------------------------------------- */

#define MARKUP_NAME "<b>\"w\"&'x'</b>"

/* The known set with worker B named MARKUP_NAME, written as dir/report.html. */
static km_analysis *html_fixture(const char *dir, char *html_path, size_t size)
{
    char path[128];
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    write_known_set(path, MARKUP_NAME);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    snprintf(html_path, size, "%s/report.html", dir);
    cr_assert_eq(km_analysis_write_html(a, html_path), KM_OK, "%s", km_analysis_last_error(a));
    return a;
}

Test(analyze, html_is_self_contained_and_escaped, .timeout = 30)
{
    char dir[64], html_path[160];
    make_temp_dir(dir);
    km_analysis *a = html_fixture(dir, html_path, sizeof html_path);
    km_text page;
    km_text_init(&page, 0);
    cr_assert_eq(km_analysis_render_html(a, &page), KM_OK);
    const char *h = km_text_cstr(&page);
    cr_expect_eq(count_of(h, "<svg "), 3);
    cr_expect(strstr(h, "id=\"chart-reuse\""));
    cr_expect(strstr(h, "id=\"chart-hit-rate\""));
    cr_expect(strstr(h, "id=\"chart-load\""));
    cr_expect_eq(count_of(h, "<circle "), 7, "one dot per compared outcome");
    cr_expect_eq(count_of(h, "class=\"window\""), 2, "both recovery windows shaded");
    cr_expect_eq(count_of(h, "class=\"worker-load\""), 2, "A and B have in_flight; C has none");
    cr_expect_null(strstr(h, "<script"));
    cr_expect_null(strstr(h, "http://www.w3.org/1999"), "no external references");
    cr_expect_null(strstr(h, MARKUP_NAME), "a worker name must never appear unescaped");
    cr_expect(strstr(h, "&lt;b&gt;&quot;w&quot;&amp;&#39;x&#39;&lt;/b&gt;"), "escaped name present");
    km_text_free(&page);

    /* the file on disk is the same page; tests/check_html.py parses its SVG parts as XML */
    if (system("command -v python3 >/dev/null 2>&1") != 0) {
        km_analysis_destroy(a);
        remove_dir(dir);
        cr_skip_test("python3 not available: SVG well-formedness not checked");
    }
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "python3 tests/check_html.py %s --expect-svg 3", html_path);
    int status = km_test_run_capture(cmd, out, sizeof out);
    cr_expect_eq(status, 0, "check_html.py failed:\n%s", out);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, html_checker_rejects_broken_reports, .timeout = 20)
{
    if (system("command -v python3 >/dev/null 2>&1") != 0)
        cr_skip_test("python3 not available");
    char dir[64], path[128];
    make_temp_dir(dir);
    const char *bad[] = {
        "<html><body><svg xmlns=\"http://www.w3.org/2000/svg\"><text>a & b</text></svg></body></html>",
        "<html><body><script src=\"x.js\"></script><svg xmlns=\"http://www.w3.org/2000/svg\">"
        "<rect/></svg></body></html>",
        "<html><body><svg xmlns=\"http://www.w3.org/2000/svg\"><rect></svg></body></html>"};
    for (size_t i = 0; i < 3; i++) {
        FILE *f = open_in(dir, "bad.html", path, sizeof path);
        fputs(bad[i], f);
        fclose(f);
        char cmd[256];
        snprintf(cmd, sizeof cmd, "python3 tests/check_html.py %s >/dev/null 2>&1", path);
        int status = system(cmd);
        cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 1, "case %zu accepted", i);
    }
    remove_dir(dir);
}

/* A headless browser, when one is installed. */
static const char *find_chromium(void)
{
    static const char *const names[] = {"chromium", "chromium-browser", "google-chrome",
                                        "google-chrome-stable"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", names[i]);
        if (system(cmd) == 0)
            return names[i];
    }
    return NULL;
}

Test(analyze, html_renders_in_headless_chromium, .timeout = 120)
{
    const char *browser = find_chromium();
    if (!browser)
        cr_skip_test("no chromium, chromium-browser or google-chrome binary on PATH: the HTML "
                     "report was not rendered in a browser (its SVG is still checked as XML)");
    char dir[64], html_path[160], dom_path[160];
    make_temp_dir(dir);
    km_analysis *a = html_fixture(dir, html_path, sizeof html_path);
    snprintf(dom_path, sizeof dom_path, "%s/dom.html", dir);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "timeout 90 %s --headless --disable-gpu --no-sandbox --no-first-run "
             "--user-data-dir=%s/profile --dump-dom file://%s > %s 2>/dev/null",
             browser, dir, html_path, dom_path);
    int status = system(cmd);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s --dump-dom failed (%d)", browser,
              status);
    snprintf(cmd, sizeof cmd, "python3 tests/check_html.py %s --expect-svg 3 --dom %s", html_path,
             dom_path);
    status = system(cmd);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the browser's DOM lacks the report's SVG charts");
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* ---- the command line ------------------------------------------------------------------------------ */

/* $KM_BIN, else build/kvmatch (relative to the repository root, where `make test` runs); fails
 * the test when it is not executable. */
static const char *kvmatch_binary(void)
{
    const char *bin = getenv("KM_BIN") && *getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (build it with make; or set KM_BIN)",
              bin);
    return bin;
}

static int run_status(const char *cmd)
{
    int status = system(cmd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

Test(analyze, cli_exit_codes_and_outputs, .timeout = 60)
{
    const char *bin = kvmatch_binary();
    char dir[64], path[128], cmd[PATH_MAX + 512];
    snprintf(cmd, sizeof cmd, "%s analyze --help 2>/dev/null | grep -q -- --html", bin);
    cr_expect_eq(run_status(cmd), 0, "`analyze --help` prints the usage with --html");
    snprintf(cmd, sizeof cmd, "%s analyze --help >/dev/null 2>&1", bin);
    cr_expect_eq(run_status(cmd), 0, "`analyze --help` exits 0");
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    write_known_set(path, "B");
    snprintf(cmd, sizeof cmd, "%s analyze >/dev/null 2>&1", bin);
    cr_expect_eq(run_status(cmd), 2, "no file is a usage error");
    snprintf(cmd, sizeof cmd, "%s analyze --bogus %s >/dev/null 2>&1", bin, path);
    cr_expect_eq(run_status(cmd), 2, "unknown option");
    snprintf(cmd, sizeof cmd, "%s analyze --html >/dev/null 2>&1", bin);
    cr_expect_eq(run_status(cmd), 2, "--html without a path");
    snprintf(cmd, sizeof cmd, "%s analyze %s/missing.jsonl >/dev/null 2>&1", bin, dir);
    cr_expect_eq(run_status(cmd), 1, "no file could be read");
    snprintf(cmd, sizeof cmd, "%s analyze %s %s/missing.jsonl > %s/out.txt 2>/dev/null", bin, path,
             dir, dir);
    cr_expect_eq(run_status(cmd), 0, "one readable file is enough");
    snprintf(cmd, sizeof cmd, "grep -q 'owner not chosen 2' %s/out.txt", dir);
    cr_expect_eq(run_status(cmd), 0, "the text report");
    snprintf(cmd, sizeof cmd, "%s analyze --json --html %s/r.html %s > %s/out.json 2>/dev/null", bin,
             dir, path, dir);
    cr_expect_eq(run_status(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s analyze %s --json | grep -q '\"by_request\": 1'", bin, path);
    cr_expect_eq(run_status(cmd), 0, "an option after the files still counts");
    snprintf(cmd, sizeof cmd, "%s/out.json", dir);
    json_error_t error;
    json_t *root = json_load_file(cmd, 0, &error);
    cr_assert(root, "--json output does not parse: %s", error.text);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(root, "reuse"), "known")), 7);
    json_decref(root);
    snprintf(cmd, sizeof cmd, "grep -c '<svg ' %s/r.html | grep -qx 3", dir);
    cr_expect_eq(run_status(cmd), 0, "the HTML report with 3 charts");
    snprintf(cmd, sizeof cmd, "%s analyze --html /nonexistent/dir/r.html %s >/dev/null 2>&1", bin, path);
    cr_expect_eq(run_status(cmd), 1, "an unwritable HTML path");
    remove_dir(dir);
}

Test(analyze, cli_report_that_cannot_be_written_exits_1, .timeout = 30)
{
    if (access("/dev/full", W_OK) != 0)
        cr_skip_test("no writable /dev/full: a failing stdout cannot be made");
    const char *bin = kvmatch_binary();
    char dir[64], path[128], cmd[PATH_MAX + 512], out[1024];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 100, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 2, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 2, .policy = "kv",
                       .cands = {{"A", "LIVE", 2, 0}}, .n_cands = 1};
    write_record(f, make_decision(&d));
    write_outcome_of(f, &d, "complete", 200, 32, 5);
    fclose(f);
    /* one decision: its text report fits in stdio's buffer, so only the flush at the end can
     * fail; the JSON report does not */
    const char *modes[] = {"", "--json"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "(%s analyze %s %s 2>&1 >/dev/full)", bin, modes[i], path);
        int status = km_test_run_capture(cmd, out, sizeof out);
        cr_expect_eq(status, 1, "analyze %s > /dev/full exited %d: %s", modes[i], status, out);
        cr_expect(strstr(out, "kvmatch analyze: writing the report: "), "analyze %s: %s",
                  modes[i], out);
    }
    remove_dir(dir);
}

/* Bytes a report must never carry as is: control characters other than its own line feeds, and
 * U+FFFE / U+FFFF. Returns the offset of the first, or -1. */
static long first_unshowable(const char *s)
{
    for (const char *p = s; *p; p++) {
        unsigned char c = (unsigned char)*p;
        if ((c < 0x20 && c != '\n') || c == 0x7F ||
            (c == 0xEF && (unsigned char)p[1] == 0xBF && ((unsigned char)p[2] & 0xFE) == 0xBE))
            return (long)(p - s);
    }
    return -1;
}

#define CONTROL_NAME "bad\x01\x1b[2Jname\t\x7f\xef\xbf\xbf"
#define CONTROL_SHOWN "bad\\x01\\x1b[2Jname\\x09\\x7f\\uFFFF"

Test(analyze, control_characters_in_record_strings_are_shown_escaped, .timeout = 30)
{
    char dir[64], path[128], html_path[160];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    write_known_set(path, CONTROL_NAME);
    /* every other string of a decision: host, pool, instance, policy, states (a recovery window
     * that never closes, an unjoined decision) */
    decision_spec d = {.instance = "i\x07", .id = 1, .request = "r1", .attempt = "0",
                       .host = "h\x1b]0;x\x07", .pool = "p\x0b", .time_ns = 10, .source = "events",
                       .prompt = 100, .owner = "A\r", .owner_state = "GAP\x01", .owner_blocks = 2,
                       .chosen = "A\r", .chosen_state = "GAP\x01", .chosen_blocks = 2,
                       .policy = "kv\x1b[31m", .cands = {{"A\r", "GAP\x01", 2, 0}}, .n_cands = 1};
    FILE *f = fopen(path, "a");
    cr_assert(f);
    write_record(f, make_decision(&d));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);

    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
    const char *t = km_text_cstr(&text);
    long bad = first_unshowable(t);
    cr_expect_eq(bad, -1, "the text report carries byte 0x%02x at %ld: %s",
                 bad < 0 ? 0 : (unsigned char)t[bad], bad, t);
    cr_expect(strstr(t, "p/" CONTROL_SHOWN ": chosen "), "%s", t);
    cr_expect(strstr(t, "h\\x1b]0;x\\x07 p\\x0b/A\\x0d (instance i\\x07): GAP\\x01 from "),
              "%s", t);
    cr_expect(strstr(t, "  kv\\x1b[31m       decisions 1,"), "%s", t);
    cr_expect(strstr(t, "decision 1 of instance i\\x07 has no outcome"), "%s", t);
    km_text_free(&text);

    km_text page;
    km_text_init(&page, 0);
    cr_assert_eq(km_analysis_render_html(a, &page), KM_OK);
    const char *h = km_text_cstr(&page);
    bad = first_unshowable(h);
    cr_expect_eq(bad, -1, "the HTML report carries byte 0x%02x at %ld",
                 bad < 0 ? 0 : (unsigned char)h[bad], bad);
    cr_expect(strstr(h, "<title>" CONTROL_SHOWN ": GAP</title>"), "the window's title");
    km_text_free(&page);

    snprintf(html_path, sizeof html_path, "%s/report.html", dir);
    cr_assert_eq(km_analysis_write_html(a, html_path), KM_OK, "%s", km_analysis_last_error(a));
    km_analysis_destroy(a);
    if (system("command -v python3 >/dev/null 2>&1") != 0) {
        remove_dir(dir);
        cr_skip_test("python3 not available: SVG well-formedness not checked");
    }
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "python3 tests/check_html.py %s --expect-svg 3", html_path);
    int status = km_test_run_capture(cmd, out, sizeof out);
    cr_expect_eq(status, 0, "check_html.py failed:\n%s", out);
    remove_dir(dir);
}

Test(analyze, chosen_deeper_than_its_owner_is_invalid, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    /* the owner holds the deepest match: B at 100 tokens cannot own one that A holds to 300 */
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 400,
                       .owner = "B", .owner_state = "LIVE", .owner_blocks = 100 / BLOCK + 1,
                       .chosen = "A", .chosen_state = "LIVE", .chosen_blocks = 300 / BLOCK,
                       .policy = "kv", .cands = {{"A", "LIVE", 300 / BLOCK, 0},
                                                 {"B", "LIVE", 100 / BLOCK + 1, 0}},
                       .n_cands = 2};
    write_record(f, make_decision(&d));                /* 1: invalid */
    write_outcome_of(f, &d, "complete", 200, 288, 5);  /* 2: an outcome without decision */
    decision_spec same = d; /* the owner chosen, at the owner's depth: valid */
    same.id = 2, same.request = "r2", same.chosen = "B", same.chosen_blocks = same.owner_blocks;
    write_record(f, make_decision(&same));             /* 3 */
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.invalid, 1);
    EQ(s->input.decisions, 1);
    cr_assert_eq(s->n_invalid_lines, 1);
    EQ(s->invalid_lines[0].line, 1);
    cr_expect_str_eq(s->invalid_lines[0].what,
                     "decision record: field decision.chosen.depth_tokens: exceeds "
                     "prediction.owner.depth_tokens (the owner holds the deepest match)");
    EQ(s->owner.decisions, 1);
    EQ(s->owner.owner_not_chosen, 0);
    EQ(s->owner.cost_tokens, 0);
    EQ(s->owner.owner_eligible.cost_tokens, 0);
    EQ(s->join.outcomes_without_decision, 1);
    km_analysis_destroy(a);
    remove_dir(dir);
}

Test(analyze, token_sums_saturate_at_the_largest_json_integer, .timeout = 20)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    /* four decisions with owner B at 3/4 of INT64_MAX tokens, A chosen at 3/8, each served by A
     * with the predicted depth cached: every token sum passes 2^63 */
    const int64_t big = INT64_MAX / BLOCK / 4 * 3, small = INT64_MAX / BLOCK / 8 * 3;
    for (int i = 0; i < 4; i++) {
        char request[8];
        snprintf(request, sizeof request, "r%d", i);
        decision_spec d = {.instance = "i", .id = i + 1, .request = request, .attempt = "0",
                           .host = "h", .pool = "p", .time_ns = 10 + i, .source = "events",
                           .prompt = INT64_MAX, .owner = "B", .owner_state = "LIVE",
                           .owner_blocks = big, .chosen = "A", .chosen_state = "LIVE",
                           .chosen_blocks = small, .policy = "kv",
                           .cands = {{"A", "LIVE", small, 0}, {"B", "LIVE", big, 0}},
                           .n_cands = 2};
        write_record(f, make_decision(&d));
        write_outcome_of(f, &d, "complete", 200, small * BLOCK, 5);
    }
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    const uint64_t max = INT64_MAX;
    EQ(s->input.invalid, 0);
    EQ(s->reuse.known, 4);
    EQ(s->reuse.predicted_tokens, max);
    EQ(s->reuse.actual_tokens, max);
    EQ(s->owner.owner_not_chosen, 4);
    EQ(s->owner.owner_tokens, max);
    EQ(s->owner.chosen_tokens, max);
    /* what was given up, summed decision by decision: 4 x 3/8 of INT64_MAX, saturated */
    EQ(s->owner.cost_tokens, max);
    EQ(s->owner.owner_eligible.cost_tokens, max);
    EQ(s->owner.joined_owner_tokens, max);
    EQ(s->outside_windows.prompt_tokens, max);
    EQ(s->outside_windows.actual_with_prompt, max);
    json_t *root = json_report(a);
    cr_expect_eq(json_count(root, "reuse", "predicted_tokens"), INT64_MAX);
    cr_expect_eq(json_count(root, "owner", "cost_tokens"), INT64_MAX);
    cr_expect_eq(json_count(root, "owner", "joined_owner_tokens"), INT64_MAX);
    json_decref(root);
    km_text text;
    km_text_init(&text, 0);
    cr_assert_eq(km_analysis_render_text(a, &text), KM_OK);
    cr_expect(strstr(km_text_cstr(&text), "predicted 9223372036854775807 tokens"), "%s",
              km_text_cstr(&text));
    km_text_free(&text);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* A policy's name is cut to fit the HTML quality table's label at a character boundary, never
 * inside a UTF-8 sequence: the page stays well-formed UTF-8 and the label ends with the last
 * whole character that fits. */
Test(analyze, html_label_of_a_long_policy_name_is_cut_between_characters, .timeout = 30)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    /* "kv-" and 80 three-byte characters: 243 bytes, over the label's 152 for a name, and 152
     * falls inside a character (3 + 49 x 3 = 150). */
    char policy[3 + 80 * 3 + 1] = "kv-";
    for (int i = 0; i < 80; i++)
        memcpy(policy + 3 + 3 * i, "\xe2\x82\xac", 3); /* U+20AC */
    policy[sizeof policy - 1] = '\0';
    FILE *f = open_in(dir, "records.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 100,
                       .owner = "A", .owner_state = "LIVE", .owner_blocks = 2, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 2, .policy = policy,
                       .cands = {{"A", "LIVE", 2, 0}}, .n_cands = 1};
    write_record(f, make_decision(&d));
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    km_text page;
    km_text_init(&page, 0);
    cr_assert_eq(km_analysis_render_html(a, &page), KM_OK);
    const char *h = km_text_cstr(&page);
    size_t n = strlen(h);
    size_t bad = km_utf8_bad_offset((const unsigned char *)h, n);
    cr_expect_eq(bad, n, "the HTML report is not UTF-8 at byte %zu: ...%.40s", bad,
                 h + (bad > 20 ? bad - 20 : 0));
    char label[256];
    snprintf(label, sizeof label, "<tr><td>policy %.150s</td>", policy);
    cr_expect(strstr(h, label), "the label holds the 49 characters that fit whole");
    km_text_free(&page);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* ---- TTFT prediction ------------------------------------------------------------------------- */

typedef struct ttft_case {
    int predicted_kind; /* 0 absent, 1 null, 2 zero, 3 a value */
    double predicted_ms;
    int64_t chosen_pending; /* -1 = null */
    int outcome_kind;       /* 0 none, 1 complete, 2 error */
    int overridden, warm_up;
    double router_ms;       /* < 0: absent */
    int64_t ttft_ns;        /* -1 = null */
} ttft_case;

static int compare_doubles(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* The nearest-rank q-th percentile of v[0..n), n > 0 (sorted here). */
static double model_percentile(double *v, size_t n, unsigned q)
{
    qsort(v, n, sizeof *v, compare_doubles);
    size_t rank = (n * q + 99) / 100;
    return v[rank ? rank - 1 : 0];
}

static void expect_ratio(const km_analysis_ttft_ratio *got, const double *observed,
                         const double *predicted, size_t n, const char *what)
{
    EQ(got->n, n);
    if (!n) {
        cr_expect(got->ratio_p50 == 0 && got->observed_p50_ms == 0, "%s: figures without pairs",
                  what);
        return;
    }
    double ratio[600], obs[600], pred[600];
    for (size_t i = 0; i < n; i++) {
        ratio[i] = observed[i] / predicted[i];
        obs[i] = observed[i];
        pred[i] = predicted[i];
    }
    double p10 = model_percentile(ratio, n, 10), p50 = model_percentile(ratio, n, 50),
           p90 = model_percentile(ratio, n, 90);
    cr_expect(got->ratio_p10 == p10 && got->ratio_p50 == p50 && got->ratio_p90 == p90,
              "%s: ratios %.17g %.17g %.17g, model %.17g %.17g %.17g", what, got->ratio_p10,
              got->ratio_p50, got->ratio_p90, p10, p50, p90);
    cr_expect(got->observed_p50_ms == model_percentile(obs, n, 50) &&
                  got->predicted_p50_ms == model_percentile(pred, n, 50),
              "%s: p50s", what);
}

/* decision.predicted_ttft_ms against the time the outcome reports, on random records, against a
 * brute-force model: only complete, joined, not overridden, not warm-up outcomes whose decision
 * predicted more than 0 are compared; router_ttft_ms when present, else ttft_ns; split by whether
 * the chosen worker's row had prefill waiting. */
Test(analyze, ttft_prediction_matches_brute_force, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed() ^ 0x7777);
    for (int round = 0; round < 20; round++) {
        char dir[64], path[128];
        make_temp_dir(dir);
        FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
        size_t n = 1 + km_rng_below(&rng, 500);
        double obs_idle[600], pred_idle[600], obs_queued[600], pred_queued[600],
            obs_all[600], pred_all[600];
        size_t n_idle = 0, n_queued = 0, n_all = 0;
        uint64_t predicted_decisions = 0, router_clock = 0, kvmatch_clock = 0;
        for (size_t i = 0; i < n; i++) {
            ttft_case c = {
                .predicted_kind = (int)km_rng_below(&rng, 4),
                .predicted_ms = 0.5 + (double)km_rng_below(&rng, 200000) / 1000.0,
                .chosen_pending = km_rng_percent(&rng, 30)   ? -1
                                  : km_rng_percent(&rng, 50) ? 0
                                                             : 1 + (int64_t)km_rng_below(&rng, 900),
                .outcome_kind = (int)km_rng_below(&rng, 3),
                .overridden = km_rng_percent(&rng, 10),
                .warm_up = km_rng_percent(&rng, 5),
                .router_ms = km_rng_percent(&rng, 60) ? (double)km_rng_below(&rng, 300000) / 1000.0
                                                      : -1,
                .ttft_ns = km_rng_percent(&rng, 70) ? (int64_t)km_rng_below(&rng, 400000000) : -1,
            };
            char request[32];
            snprintf(request, sizeof request, "r%zu", i);
            decision_spec d = {.instance = "i", .id = (int64_t)i + 1, .request = request,
                               .attempt = "0", .host = "h", .pool = "p",
                               .time_ns = (int64_t)i * 1000 + 1, .source = "events",
                               .prompt = 640, .owner = "A", .owner_state = "LIVE",
                               .owner_blocks = 4, .chosen = "A", .chosen_state = "LIVE",
                               .chosen_blocks = 4, .policy = "ttft",
                               .cands = {{"A", "LIVE", 4, 1}, {"B", "LIVE", 0, 0}},
                               .eligible = {ELIGIBLE_TRUE, ELIGIBLE_TRUE}, .n_cands = 2,
                               .warm_up = c.warm_up, .warm_up_for = 1};
            json_t *dec = make_decision(&d);
            json_t *decision = json_object_get(dec, "decision");
            if (c.predicted_kind == 1)
                json_object_set_new(decision, "predicted_ttft_ms", json_null());
            else if (c.predicted_kind == 2)
                json_object_set_new(decision, "predicted_ttft_ms", json_real(0.0));
            else if (c.predicted_kind == 3)
                json_object_set_new(decision, "predicted_ttft_ms", json_real(c.predicted_ms));
            json_object_set_new(json_array_get(json_object_get(dec, "candidates"), 0),
                                "pending_prefill_tokens", nullable_int(c.chosen_pending));
            write_record(f, dec);
            if (c.outcome_kind) {
                outcome_spec o = outcome_for(&d, c.outcome_kind == 1 ? "complete" : "error", 200,
                                             64, c.ttft_ns);
                if (c.overridden)
                    o.dispatched = "B";
                json_t *out = make_outcome(&o);
                if (c.router_ms >= 0)
                    json_object_set_new(out, "router_ttft_ms", json_real(c.router_ms));
                write_record(f, out);
            }
            if (c.warm_up || c.predicted_kind < 2)
                continue;
            predicted_decisions++;
            if (c.outcome_kind != 1 || c.overridden || c.predicted_kind != 3)
                continue;
            double observed;
            if (c.router_ms >= 0) {
                observed = c.router_ms;
                router_clock++;
            } else if (c.ttft_ns >= 0) {
                observed = (double)c.ttft_ns / 1e6;
                kvmatch_clock++;
            } else {
                continue;
            }
            obs_all[n_all] = observed;
            pred_all[n_all++] = c.predicted_ms;
            if (c.chosen_pending > 0) {
                obs_queued[n_queued] = observed;
                pred_queued[n_queued++] = c.predicted_ms;
            } else {
                obs_idle[n_idle] = observed;
                pred_idle[n_idle++] = c.predicted_ms;
            }
        }
        fclose(f);
        const char *paths[] = {path};
        km_analysis *a = analyze_files(NULL, paths, 1);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        EQ(s->input.invalid, 0);
        const km_analysis_ttft_prediction *tp = &s->ttft_prediction;
        EQ(tp->decisions_predicted, predicted_decisions);
        EQ(tp->router_clock, router_clock);
        EQ(tp->kvmatch_clock, kvmatch_clock);
        expect_ratio(&tp->all, obs_all, pred_all, n_all, "all");
        expect_ratio(&tp->idle, obs_idle, pred_idle, n_idle, "idle");
        expect_ratio(&tp->queued, obs_queued, pred_queued, n_queued, "queued");
        json_t *root = json_report(a);
        EQ(json_count(json_object_get(root, "ttft_prediction"), "all", "n"), n_all);
        EQ(json_count(root, "ttft_prediction", "router_clock"), router_clock);
        json_decref(root);
        km_analysis_destroy(a);
        remove_dir(dir);
    }
}

/* A predicted_ttft_ms or a pending_prefill_tokens of the wrong kind makes the line invalid, named
 * by its field; the lines around it still count. A valid prediction whose ratio to the observed
 * time overflows is not compared, and the JSON report still has the section. */
Test(analyze, bad_ttft_prediction_fields_are_invalid_lines, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    FILE *f = open_in(dir, "r.jsonl", path, sizeof path);
    decision_spec d = {.instance = "i", .id = 1, .request = "r1", .attempt = "0", .host = "h",
                       .pool = "p", .time_ns = 10, .source = "events", .prompt = 64, .owner = "A",
                       .owner_state = "LIVE", .owner_blocks = 3, .chosen = "A",
                       .chosen_state = "LIVE", .chosen_blocks = 3, .policy = "ttft",
                       .cands = {{"A", "LIVE", 3, 0}}, .n_cands = 1};
    json_t *bad_values[] = {json_real(-1.0), json_string("12"), json_true()};
    for (int i = 0; i < 3; i++) {
        d.id = i + 1;
        json_t *dec = make_decision(&d);
        json_object_set_new(json_object_get(dec, "decision"), "predicted_ttft_ms", bad_values[i]);
        write_record(f, dec);
    }
    d.id = 4;
    json_t *dec = make_decision(&d);
    json_object_set_new(json_array_get(json_object_get(dec, "candidates"), 0),
                        "pending_prefill_tokens", json_string("many"));
    write_record(f, dec);
    d.id = 5;
    dec = make_decision(&d);
    json_object_set_new(json_object_get(dec, "decision"), "predicted_ttft_ms", json_real(20.0));
    write_record(f, dec);
    /* valid, but a ratio too large to hold: predicted, not compared, and the report whole */
    d.id = 6;
    d.request = "r6";
    dec = make_decision(&d);
    json_object_set_new(json_object_get(dec, "decision"), "predicted_ttft_ms", json_real(1e-300));
    write_record(f, dec);
    outcome_spec o = outcome_for(&d, "complete", 200, 48, -1);
    json_t *out = make_outcome(&o);
    json_object_set_new(out, "router_ttft_ms", json_real(1e10));
    write_record(f, out);
    fclose(f);
    const char *paths[] = {path};
    km_analysis *a = analyze_files(NULL, paths, 1);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    EQ(s->input.invalid, 4);
    EQ(s->input.decisions, 2);
    EQ(s->ttft_prediction.decisions_predicted, 2);
    EQ(s->ttft_prediction.all.n, 0);
    json_t *root = json_report(a);
    EQ(json_count(root, "ttft_prediction", "decisions_predicted"), 2);
    json_decref(root);
    for (int i = 0; i < 3; i++)
        cr_expect(strstr(s->invalid_lines[i].what, "decision.predicted_ttft_ms"), "line %d: %s",
                  i + 1, s->invalid_lines[i].what);
    cr_expect(strstr(s->invalid_lines[3].what, "candidates[0].pending_prefill_tokens"), "%s",
              s->invalid_lines[3].what);
    km_analysis_destroy(a);
    remove_dir(dir);
}

/* ---- joins, duplicates and warm-ups against a brute-force reading --------------------------- */

/* Record sets shaped for the join: three instances (two hosts and a null one), requests decided
 * several times (retries, and one request decided on two instances), outcomes joined by decision
 * id, by (request_id, attempt_id) from another instance (on another host), written by the
 * decision's own instance under another id (never its), or missing; outcomes without decision;
 * decision and outcome lines written twice; warm-ups marked by warm_up_for, or by an attempt id
 * ending ":warm_up" alone; router overrides; copies that disagree with their decision; all spread
 * over files given in a random order. A brute-force reader replays the lines in that order as
 * docs/ANALYZE.md describes the join and recomputes the input, join, reuse, owner, outcome,
 * policy, reason, worker and host figures, and the unjoined lists line by line. */
#define JR_FILES 5
#define JR_WORKERS 4

static const char *const jr_instances[3] = {"iA", "iB", "iC"};
static const char *const jr_hosts[3] = {"h1", "h2", NULL};
static const char *const jr_workers[JR_WORKERS] = {"W0", "W1", "W2", "W3"};

typedef struct jr_decision {
    decision_spec spec;
    char request[24], attempt[24];
    int copies;
} jr_decision;

typedef struct jr_outcome {
    outcome_spec spec;
    char request[24], attempt[24];
    int copies;
} jr_outcome;

typedef struct jr_line {
    int is_decision, index;
} jr_line;

/* A point of the brute-force reader: one (instance, decision_id). */
typedef struct jr_point {
    const char *instance;
    int64_t id;
    int decision, outcome; /* indices, -1 = none */
    int decision_file, outcome_file;
    uint64_t decision_line, outcome_line;
    int by_request, merged_away;
} jr_point;

static int jr_host_index(const char *host)
{
    return !host ? 2 : !strcmp(host, "h1") ? 0 : 1;
}

static int jr_ends_warm_up(const char *attempt)
{
    size_t n = strlen(attempt), k = strlen(":warm_up");
    return n >= k && !strcmp(attempt + n - k, ":warm_up");
}

Test(analyze, random_joins_duplicates_and_warm_ups_match_brute_force, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    char dir[64];
    make_temp_dir(dir);
    for (int round = 0; round < 4; round++) {
        size_t n = 60 + km_rng_below(&rng, 340);
        size_t n_orphans = km_rng_below(&rng, 40);
        size_t n_requests = n / 3 + 1;
        jr_decision *d = calloc(n, sizeof *d);
        jr_outcome *o = calloc(n + n_orphans, sizeof *o);
        jr_line *lines[JR_FILES];
        size_t n_lines[JR_FILES] = {0};
        for (int f = 0; f < JR_FILES; f++)
            lines[f] = calloc(4 * (n + n_orphans), sizeof *lines[f]);
        cr_assert(d && o);
        int64_t next_id[3] = {0, 0, 0};
        size_t n_o = 0;
        for (size_t i = 0; i < n; i++) {
            jr_decision *r = &d[i];
            decision_spec *s = &r->spec;
            int inst = (int)km_rng_below(&rng, 3);
            uint32_t attempt_kind = km_rng_below(&rng, 10);
            snprintf(r->request, sizeof r->request, "q%u",
                     km_rng_below(&rng, (uint32_t)n_requests));
            snprintf(r->attempt, sizeof r->attempt, "%s",
                     attempt_kind < 4 ? "0" : attempt_kind < 8 ? "1" : "0:warm_up");
            static const char *const reasons[3] = {"min_cost", "spread", NULL};
            uint32_t why = km_rng_below(&rng, 3);
            *s = (decision_spec){.instance = jr_instances[inst], .id = next_id[inst]++,
                                 .request = r->request, .attempt = r->attempt,
                                 .host = jr_hosts[inst],
                                 .pool = km_rng_below(&rng, 2) ? "p0" : "p1",
                                 .time_ns = (int64_t)(i + 1) * 1000, .source = "events",
                                 .prompt = km_rng_percent(&rng, 15)
                                               ? -1
                                               : (int64_t)(320 + km_rng_below(&rng, 700)),
                                 .policy = km_rng_below(&rng, 2) ? "kv" : "ttft",
                                 .reason = reasons[why], .null_reason = why == 2};
            /* a warm-up by warm_up_for, or (now and then) by its attempt id alone */
            s->warm_up = attempt_kind >= 8 && km_rng_percent(&rng, 50);
            for (int w = 0; w < JR_WORKERS; w++)
                if (km_rng_percent(&rng, 60) || (w == JR_WORKERS - 1 && s->n_cands == 0))
                    s->cands[s->n_cands++] =
                        (cand_spec){jr_workers[w], "LIVE", km_rng_below(&rng, 21),
                                    (int64_t)km_rng_below(&rng, 9)};
            const cand_spec *chosen = &s->cands[km_rng_below(&rng, (uint32_t)s->n_cands)];
            s->chosen = chosen->worker, s->chosen_state = "LIVE";
            s->chosen_blocks = chosen->depth_blocks;
            const cand_spec *owner = NULL;
            for (int c = 0; c < s->n_cands; c++)
                if (s->cands[c].depth_blocks > 0 &&
                    (!owner || s->cands[c].depth_blocks > owner->depth_blocks))
                    owner = &s->cands[c];
            if (owner)
                s->owner = owner->worker, s->owner_state = "LIVE",
                s->owner_blocks = owner->depth_blocks;
            r->copies = km_rng_percent(&rng, 10) ? 2 : 1;
            for (int c = 0; c < r->copies; c++) {
                int f = (int)km_rng_below(&rng, JR_FILES);
                lines[f][n_lines[f]++] = (jr_line){1, (int)i};
            }
            /* its outcome: by id (55%), from another instance (15%), from its own instance
             * under another id (8%), or none */
            uint32_t mode = km_rng_below(&rng, 100);
            if (mode >= 78)
                continue;
            jr_outcome *out = &o[n_o];
            static const char *const kinds[5] = {"complete", "incomplete", "error", "cancelled",
                                                 "expired"};
            int64_t http[3] = {200, 500, -1};
            int64_t cached = km_rng_percent(&rng, 20) ? -1 : (int64_t)km_rng_below(&rng, 401);
            int64_t ttft = km_rng_percent(&rng, 40) ? -1
                                                    : (int64_t)(1 + km_rng_below(&rng, 1000000));
            out->spec = outcome_for(s, kinds[km_rng_below(&rng, 5)], http[km_rng_below(&rng, 3)],
                                    cached, ttft);
            memcpy(out->request, r->request, sizeof out->request);
            memcpy(out->attempt, r->attempt, sizeof out->attempt);
            out->spec.request = out->request;
            out->spec.attempt = out->attempt;
            if (mode >= 55 && mode < 70) {
                int other = (inst + 1 + (int)km_rng_below(&rng, 2)) % 3;
                out->spec.instance = jr_instances[other];
                out->spec.host = jr_hosts[other];
                out->spec.id = 1000000 + (int64_t)i;
            } else if (mode >= 70) {
                out->spec.id = 2000000 + (int64_t)i;
            }
            if (km_rng_percent(&rng, 25))
                out->spec.dispatched = jr_workers[km_rng_below(&rng, JR_WORKERS)];
            if (km_rng_percent(&rng, 5))
                out->spec.predicted_blocks++; /* a copy that disagrees with its decision */
            out->copies = km_rng_percent(&rng, 10) ? 2 : 1;
            for (int c = 0; c < out->copies; c++) {
                int f = (int)km_rng_below(&rng, JR_FILES);
                lines[f][n_lines[f]++] = (jr_line){0, (int)n_o};
            }
            n_o++;
        }
        for (size_t k = 0; k < n_orphans; k++) {
            jr_outcome *out = &o[n_o];
            const decision_spec *like = &d[km_rng_below(&rng, (uint32_t)n)].spec;
            int64_t cached = km_rng_percent(&rng, 20) ? -1 : (int64_t)km_rng_below(&rng, 401);
            out->spec = outcome_for(like, "complete", 200, cached,
                                    (int64_t)(1 + km_rng_below(&rng, 1000000)));
            snprintf(out->request, sizeof out->request, "orphan%zu", k);
            snprintf(out->attempt, sizeof out->attempt, "%s",
                     km_rng_percent(&rng, 30) ? "0:warm_up" : "0");
            out->spec.request = out->request;
            out->spec.attempt = out->attempt;
            out->spec.id = 3000000 + (int64_t)k;
            if (km_rng_percent(&rng, 30))
                out->spec.dispatched = jr_workers[km_rng_below(&rng, JR_WORKERS)];
            out->copies = 1;
            int f = (int)km_rng_below(&rng, JR_FILES);
            lines[f][n_lines[f]++] = (jr_line){0, (int)n_o};
            n_o++;
        }

        /* write the files, and choose the order they are given in */
        char paths[JR_FILES][128];
        for (int f = 0; f < JR_FILES; f++) {
            char name[32];
            snprintf(name, sizeof name, "join%d-%d.jsonl", round, f);
            FILE *file = open_in(dir, name, paths[f], sizeof paths[f]);
            for (size_t l = 0; l < n_lines[f]; l++)
                write_record(file, lines[f][l].is_decision
                                       ? make_decision(&d[lines[f][l].index].spec)
                                       : make_outcome(&o[lines[f][l].index].spec));
            fclose(file);
        }
        int order[JR_FILES];
        for (int f = 0; f < JR_FILES; f++)
            order[f] = f;
        for (int f = JR_FILES - 1; f > 0; f--) {
            int j = (int)km_rng_below(&rng, (uint32_t)f + 1), t = order[f];
            order[f] = order[j];
            order[j] = t;
        }

        /* the brute-force reader: lines in the order given, points by (instance, decision_id) */
        size_t cap = 2 * (n + n_o) + 1, n_points = 0;
        jr_point *pt = calloc(cap, sizeof *pt);
        cr_assert(pt);
        km_analysis_summary m;
        memset(&m, 0, sizeof m);
        for (int k = 0; k < JR_FILES; k++) {
            int f = order[k];
            for (size_t l = 0; l < n_lines[f]; l++) {
                const jr_line *line = &lines[f][l];
                const char *instance = line->is_decision ? d[line->index].spec.instance
                                                         : o[line->index].spec.instance;
                int64_t id = line->is_decision ? d[line->index].spec.id : o[line->index].spec.id;
                size_t p = 0;
                while (p < n_points && (strcmp(pt[p].instance, instance) || pt[p].id != id))
                    p++;
                if (p == n_points)
                    pt[n_points++] = (jr_point){instance, id, -1, -1, 0, 0, 0, 0, 0, 0};
                int *slot = line->is_decision ? &pt[p].decision : &pt[p].outcome;
                if (line->is_decision)
                    m.input.decisions++;
                else
                    m.input.outcomes++;
                if (*slot >= 0) {
                    if (line->is_decision)
                        m.join.duplicate_decisions++;
                    else
                        m.join.duplicate_outcomes++;
                    continue;
                }
                if (pt[p].decision >= 0 || pt[p].outcome >= 0)
                    m.join.by_decision_id++;
                *slot = line->index;
                if (line->is_decision)
                    pt[p].decision_file = f, pt[p].decision_line = l + 1;
                else
                    pt[p].outcome_file = f, pt[p].outcome_line = l + 1;
            }
        }
        /* by (request_id, attempt_id): each decision, in reading order, takes the first outcome
         * of its key from another instance */
        for (size_t p = 0; p < n_points; p++) {
            if (pt[p].decision < 0 || pt[p].outcome >= 0)
                continue;
            const decision_spec *ds = &d[pt[p].decision].spec;
            for (size_t q = 0; q < n_points; q++) {
                if (pt[q].decision >= 0 || pt[q].outcome < 0 || pt[q].merged_away)
                    continue;
                const outcome_spec *os = &o[pt[q].outcome].spec;
                if (strcmp(os->request, ds->request) || strcmp(os->attempt, ds->attempt) ||
                    !strcmp(os->instance, ds->instance))
                    continue;
                pt[p].outcome = pt[q].outcome;
                pt[p].by_request = 1;
                pt[q].merged_away = 1;
                m.join.by_request++;
                break;
            }
        }
        /* the figures over the points counted: neither merged away nor warm-ups */
        model_worker workers[3][2][JR_WORKERS];
        memset(workers, 0, sizeof workers);
        km_analysis_quality quality[2]; /* kv, ttft */
        memset(quality, 0, sizeof quality);
        km_analysis_reason reasons[2][3];
        memset(reasons, 0, sizeof reasons);
        int64_t *ttfts = calloc(n_points + 1, sizeof *ttfts);
        size_t n_ttft = 0;
        int hosts_seen[3] = {0, 0, 0};
        jr_point *unjoined_d[KM_ANALYSIS_DEFAULT_MAX_LISTED];
        jr_point *unjoined_o[KM_ANALYSIS_DEFAULT_MAX_LISTED];
        size_t n_unjoined_d = 0, n_unjoined_o = 0;
        for (size_t p = 0; p < n_points; p++) {
            jr_point *q = &pt[p];
            if (q->merged_away)
                continue;
            const decision_spec *ds = q->decision >= 0 ? &d[q->decision].spec : NULL;
            const outcome_spec *os = q->outcome >= 0 ? &o[q->outcome].spec : NULL;
            int warm = (ds && ds->warm_up) || (os && jr_ends_warm_up(os->attempt));
            if (warm) {
                m.input.warm_ups += ds != NULL;
                continue;
            }
            const char *host = ds ? ds->host : os->host;
            hosts_seen[jr_host_index(host)] = 1;
            if (os) {
                int overridden = model_overridden(os);
                int64_t predicted;
                if (overridden) {
                    int w = 0;
                    while (strcmp(jr_workers[w], os->dispatched))
                        w++;
                    workers[jr_host_index(host)][strcmp(os->pool, "p0") ? 1 : 0][w]
                        .dispatched_by_override++;
                }
                m.reuse.outcomes++;
                if (os->cached < 0) {
                    m.reuse.unknown++;
                } else if (!model_prediction(ds, os, &predicted)) {
                    m.reuse.overridden_unpredicted++;
                } else {
                    m.reuse.known++;
                    m.reuse.overridden += overridden;
                    m.reuse.from_outcome_copy += ds == NULL;
                    m.reuse.predicted_tokens += (uint64_t)predicted;
                    m.reuse.actual_tokens += (uint64_t)os->cached;
                    int64_t diff = os->cached - predicted;
                    m.reuse.exact += diff == 0;
                    m.reuse.over_predicted += diff < 0;
                    m.reuse.under_predicted += diff > 0;
                    m.reuse.difference_buckets[model_bucket(diff)]++;
                }
                if (!strcmp(os->outcome, "complete")) {
                    m.outcomes.complete++;
                    if (os->ttft_ns >= 0)
                        ttfts[n_ttft++] = os->ttft_ns;
                } else if (!strcmp(os->outcome, "incomplete")) {
                    m.outcomes.incomplete++;
                    m.outcomes.incomplete_http_200 += os->http_status == 200;
                } else if (!strcmp(os->outcome, "error")) {
                    m.outcomes.error++;
                } else if (!strcmp(os->outcome, "cancelled")) {
                    m.outcomes.cancelled++;
                } else {
                    m.outcomes.expired++;
                }
                /* a worker is a (host, pool, name): a copy from another pool names another */
                if (ds && (strcmp(os->worker, ds->chosen) || strcmp(os->pool, ds->pool) ||
                           os->predicted_blocks != ds->chosen_blocks))
                    m.join.copy_mismatches++;
                if (!ds) {
                    m.join.outcomes_without_decision++;
                    if (n_unjoined_o < KM_ANALYSIS_DEFAULT_MAX_LISTED)
                        unjoined_o[n_unjoined_o++] = q;
                }
            }
            if (!ds)
                continue;
            if (!os) {
                m.join.decisions_without_outcome++;
                if (n_unjoined_d < KM_ANALYSIS_DEFAULT_MAX_LISTED)
                    unjoined_d[n_unjoined_d++] = q;
            }
            m.owner.decisions++;
            int not_chosen = ds->owner && strcmp(ds->owner, ds->chosen);
            if (!ds->owner)
                m.owner.no_owner++;
            else if (not_chosen) {
                m.owner.owner_not_chosen++;
                m.owner.cost_tokens += (uint64_t)(ds->owner_blocks - ds->chosen_blocks) * BLOCK;
            } else
                m.owner.owner_is_chosen++;
            if (os && model_overridden(os)) {
                m.owner.overridden++;
                m.owner.overridden_to_owner += ds->owner && !strcmp(ds->owner, os->dispatched);
            }
            int w = 0;
            while (strcmp(jr_workers[w], ds->chosen))
                w++;
            workers[jr_host_index(ds->host)][strcmp(ds->pool, "p0") ? 1 : 0][w].chosen++;
            /* quality: the model of the other random test, on this decision and its outcome */
            rand_decision rd = {.spec = *ds, .outcome_mode = os != NULL};
            if (os) {
                rd.outcome = *os;
                if (os->prompt >= 0) /* the outcome's prompt_tokens, else the decision's */
                    rd.spec.prompt = os->prompt;
            }
            model_quality_add(&quality[strcmp(ds->policy, "kv") ? 1 : 0], &rd);
            km_analysis_reason *row =
                &reasons[strcmp(ds->policy, "kv") ? 1 : 0][ds->null_reason ? 2
                                                           : !strcmp(ds->reason, "min_cost") ? 0
                                                                                             : 1];
            row->decisions++;
            if (not_chosen) {
                row->owner_not_chosen++;
                row->given_up_tokens += (uint64_t)(ds->owner_blocks - ds->chosen_blocks) * BLOCK;
            }
        }
        for (int h = 0; h < 3; h++)
            m.input.hosts += (uint64_t)hosts_seen[h];

        const char *given[JR_FILES];
        for (int k = 0; k < JR_FILES; k++)
            given[k] = paths[order[k]];
        km_analysis *a = analyze_files(NULL, given, JR_FILES);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        KM_CHECK(s->input.invalid == 0, "round %d: invalid %" PRIu64, round, s->input.invalid);
#define SAME(field)                                                                                \
    KM_CHECK(s->field == m.field, "round %d: %s = %" PRIu64 ", model %" PRIu64, round, #field,     \
             (uint64_t)s->field, (uint64_t)m.field)
        SAME(input.decisions);
        SAME(input.outcomes);
        SAME(input.warm_ups);
        SAME(input.hosts);
        SAME(join.by_decision_id);
        SAME(join.by_request);
        SAME(join.decisions_without_outcome);
        SAME(join.outcomes_without_decision);
        SAME(join.duplicate_decisions);
        SAME(join.duplicate_outcomes);
        SAME(join.copy_mismatches);
        SAME(reuse.outcomes);
        SAME(reuse.unknown);
        SAME(reuse.overridden_unpredicted);
        SAME(reuse.known);
        SAME(reuse.overridden);
        SAME(reuse.from_outcome_copy);
        SAME(reuse.predicted_tokens);
        SAME(reuse.actual_tokens);
        SAME(reuse.exact);
        SAME(reuse.over_predicted);
        SAME(reuse.under_predicted);
        for (int b = 0; b < KM_ANALYSIS_DIFF_BUCKETS; b++)
            SAME(reuse.difference_buckets[b]);
        SAME(owner.decisions);
        SAME(owner.no_owner);
        SAME(owner.owner_is_chosen);
        SAME(owner.owner_not_chosen);
        SAME(owner.cost_tokens);
        SAME(owner.overridden);
        SAME(owner.overridden_to_owner);
        SAME(outcomes.complete);
        SAME(outcomes.incomplete);
        SAME(outcomes.incomplete_http_200);
        SAME(outcomes.error);
        SAME(outcomes.cancelled);
        SAME(outcomes.expired);
#undef SAME
        qsort(ttfts, n_ttft, sizeof *ttfts, compare_i64s);
        KM_CHECK(s->outcomes.ttft_known == n_ttft, "round %d: ttft_known %" PRIu64 ", model %zu",
                 round, s->outcomes.ttft_known, n_ttft);
        if (n_ttft) {
            size_t r50 = (n_ttft + 1) / 2, r99 = (n_ttft * 99 + 99) / 100;
            KM_CHECK(s->outcomes.ttft_p50_ms == (double)ttfts[r50 - 1] / 1e6 &&
                         s->outcomes.ttft_p99_ms == (double)ttfts[r99 - 1] / 1e6,
                     "round %d: ttft p50 %f p99 %f", round, s->outcomes.ttft_p50_ms,
                     s->outcomes.ttft_p99_ms);
        }
        /* quality per policy, decisions by (policy, reason) */
        for (size_t k = 0; k < s->n_policies; k++) {
            const km_analysis_quality *got = &s->policies[k].quality;
            const km_analysis_quality *want = &quality[strcmp(s->policies[k].policy, "kv") ? 1 : 0];
            KM_CHECK(got->decisions == want->decisions && got->owner_not_chosen ==
                         want->owner_not_chosen && got->known == want->known &&
                         got->overridden == want->overridden &&
                         got->overridden_unpredicted == want->overridden_unpredicted &&
                         got->predicted_tokens == want->predicted_tokens &&
                         got->actual_tokens == want->actual_tokens && got->exact == want->exact &&
                         got->prompt_tokens == want->prompt_tokens &&
                         got->actual_with_prompt == want->actual_with_prompt,
                     "round %d: policy %s quality (decisions %" PRIu64 " owner_not_chosen %" PRIu64
                     " known %" PRIu64 " overridden %" PRIu64 " unpredicted %" PRIu64
                     " predicted %" PRIu64 " actual %" PRIu64 " exact %" PRIu64 " prompt %" PRIu64
                     " with prompt %" PRIu64 ") != model (%" PRIu64 " %" PRIu64 " %" PRIu64
                     " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                     " %" PRIu64 ")",
                     round, s->policies[k].policy, got->decisions, got->owner_not_chosen,
                     got->known, got->overridden, got->overridden_unpredicted,
                     got->predicted_tokens, got->actual_tokens, got->exact, got->prompt_tokens,
                     got->actual_with_prompt, want->decisions, want->owner_not_chosen,
                     want->known, want->overridden, want->overridden_unpredicted,
                     want->predicted_tokens, want->actual_tokens, want->exact,
                     want->prompt_tokens, want->actual_with_prompt);
        }
        size_t reason_rows = 0;
        for (int pol = 0; pol < 2; pol++)
            for (int why = 0; why < 3; why++)
                reason_rows += reasons[pol][why].decisions > 0;
        KM_CHECK(s->n_reasons == reason_rows, "round %d: %zu reason rows, model %zu", round,
                 s->n_reasons, reason_rows);
        for (size_t k = 0; k < s->n_reasons; k++) {
            const km_analysis_reason *got = &s->reasons[k];
            const km_analysis_reason *want =
                &reasons[strcmp(got->policy, "kv") ? 1 : 0][!*got->reason ? 2
                                                            : !strcmp(got->reason, "min_cost") ? 0
                                                                                               : 1];
            KM_CHECK(got->decisions == want->decisions &&
                         got->owner_not_chosen == want->owner_not_chosen &&
                         got->given_up_tokens == want->given_up_tokens,
                     "round %d: reason %s / %s differs from the model", round, got->policy,
                     got->reason);
        }
        /* workers by (host, pool, name): an outcome from another host names its workers as the
         * decision's host does */
        size_t worker_rows = 0;
        for (int h = 0; h < 3; h++)
            for (int p = 0; p < 2; p++)
                for (int w = 0; w < JR_WORKERS; w++)
                    worker_rows += workers[h][p][w].chosen ||
                                   workers[h][p][w].dispatched_by_override;
        KM_CHECK(s->n_workers == worker_rows, "round %d: %zu worker rows, model %zu", round,
                 s->n_workers, worker_rows);
        for (size_t k = 0; k < s->n_workers; k++) {
            const km_analysis_worker *got = &s->workers[k];
            int h = !*got->host ? 2 : !strcmp(got->host, "h1") ? 0 : 1, w = 0;
            while (w < JR_WORKERS - 1 && strcmp(jr_workers[w], got->worker))
                w++;
            const model_worker *want = &workers[h][strcmp(got->pool, "p0") ? 1 : 0][w];
            KM_CHECK(got->chosen == want->chosen &&
                         got->dispatched_by_override == want->dispatched_by_override,
                     "round %d: worker %s/%s/%s chosen %" PRIu64 " dispatched %" PRIu64
                     ", model %" PRIu64 " %" PRIu64,
                     round, got->host, got->pool, got->worker, got->chosen,
                     got->dispatched_by_override, want->chosen, want->dispatched_by_override);
        }
        /* the unjoined lists: the first ones counted, in reading order, at their first line */
        KM_CHECK(s->n_unjoined_decisions == n_unjoined_d && s->n_unjoined_outcomes == n_unjoined_o,
                 "round %d: %zu unjoined decisions and %zu outcomes listed, model %zu and %zu",
                 round, s->n_unjoined_decisions, s->n_unjoined_outcomes, n_unjoined_d,
                 n_unjoined_o);
        for (size_t k = 0; k < n_unjoined_d && k < s->n_unjoined_decisions; k++)
            KM_CHECK(!strcmp(s->unjoined_decisions[k].file, paths[unjoined_d[k]->decision_file]) &&
                         s->unjoined_decisions[k].line == unjoined_d[k]->decision_line,
                     "round %d: unjoined decision %zu at %s:%" PRIu64 ", model %s:%" PRIu64,
                     round, k, s->unjoined_decisions[k].file, s->unjoined_decisions[k].line,
                     paths[unjoined_d[k]->decision_file], unjoined_d[k]->decision_line);
        for (size_t k = 0; k < n_unjoined_o && k < s->n_unjoined_outcomes; k++)
            KM_CHECK(!strcmp(s->unjoined_outcomes[k].file, paths[unjoined_o[k]->outcome_file]) &&
                         s->unjoined_outcomes[k].line == unjoined_o[k]->outcome_line,
                     "round %d: unjoined outcome %zu at %s:%" PRIu64 ", model %s:%" PRIu64,
                     round, k, s->unjoined_outcomes[k].file, s->unjoined_outcomes[k].line,
                     paths[unjoined_o[k]->outcome_file], unjoined_o[k]->outcome_line);
        km_analysis_destroy(a);
        free(ttfts);
        free(pt);
        for (int f = 0; f < JR_FILES; f++)
            free(lines[f]);
        free(o);
        free(d);
    }
    remove_dir(dir);
}
