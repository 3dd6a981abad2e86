/* SPDX-License-Identifier: Apache-2.0 */
/* Decision policies (include/kvmatch/policy.h): expected choices on hand-built cases for every
 * policy ("best match on A under the threshold, B chosen", tie breaks, the imbalance
 * thresholds exactly at and just over, tier weights changing the choice), bad input, and property
 * tests against a brute-force oracle written differently (integer arithmetic and a full sort of
 * key tuples instead of a running minimum in doubles): kv at temperature 0, prefix, least_load,
 * cache_aware, the owner; round robin visits; softmax determinism and frequencies. */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvmatch/policy.h"

/* ---- helpers -------------------------------------------------------------------------------- */

static km_policy_candidate cand(uint32_t worker, uint32_t device, uint32_t host, uint32_t disk,
                                uint32_t in_flight, uint64_t pending, uint64_t decode)
{
    km_policy_candidate c;
    memset(&c, 0, sizeof c);
    c.worker = worker;
    c.device_blocks = device;
    c.host_blocks = host;
    c.disk_blocks = disk;
    c.depth = device + host + disk;
    c.in_flight = in_flight;
    c.pending_prefill_tokens = pending;
    c.active_decode_blocks = decode;
    return c;
}

static km_policy_request request(uint32_t n_blocks, uint32_t block_size)
{
    km_policy_request r;
    memset(&r, 0, sizeof r);
    r.n_blocks = n_blocks;
    r.block_size = block_size;
    return r;
}

static km_policy_config config(km_policy_kind kind)
{
    km_policy_config cfg;
    km_policy_config_init(&cfg);
    cfg.kind = kind;
    return cfg;
}

/* Decide and require success. */
static km_policy_decision decide(const km_policy_config *cfg, km_policy_state *st,
                                 const km_policy_request *req, const km_policy_candidate *c,
                                 uint32_t n, double *costs)
{
    km_policy_decision d;
    int rc = km_policy_decide(cfg, st, req, c, n, &d, costs);
    cr_assert_eq(rc, KM_OK, "decide failed: %s", km_policy_last_error(st));
    cr_assert_str_empty(km_policy_last_error(st));
    cr_assert_lt(d.chosen, n);
    cr_assert_eq(d.chosen_depth, c[d.chosen].depth);
    if (d.owner == KM_POLICY_NO_OWNER)
        cr_assert_eq(d.owner_depth, 0);
    else
        cr_assert_eq(d.owner_depth, c[d.owner].depth);
    if (costs) /* both NAN for round_robin, which has no cost */
        cr_assert(d.chosen_cost == costs[d.chosen] ||
                      (isnan(d.chosen_cost) && isnan(costs[d.chosen])),
                  "chosen_cost %g, costs[chosen] %g", d.chosen_cost, costs[d.chosen]);
    return d;
}

/* ---- configuration and names -------------------------------------------------------------- */

Test(policy, config_defaults_are_the_peers, .timeout = 30)
{
    km_policy_config cfg;
    km_policy_config_init(&cfg);
    /* The default kind is the one that won the routing benchmark (docs/BENCHMARKS.md, "Routing");
     * every policy's parameters default to its peer's. */
    cr_assert_eq(cfg.kind, KM_POLICY_TTFT);
    cr_assert_eq(cfg.llmd.prefix_weight, 2.0);
    cr_assert_eq(cfg.llmd.queue_weight, 1.0);
    cr_assert_eq(cfg.llmd.kv_usage_weight, 1.0);
    cr_assert_eq(cfg.llmd.host_tier_weight, 0.8);
    cr_assert_eq(cfg.preble.exploit_ratio, 1.0);
    cr_assert_eq(cfg.ttft.load_bound, 1.25);
    cr_assert_eq(cfg.ttft.hot_prefix_sharers, 1);
    cr_assert_eq(cfg.ttft.hot_prefix_share, 0.25);
    cr_assert_eq(cfg.ttft.spread_ms, 1.0);
    km_engine_model m;
    km_engine_model_init(&m);
    cr_assert(memcmp(&cfg.engine, &m, sizeof m) == 0);
    cr_assert_eq(cfg.kv.prefill_load_scale, 1.0);
    cr_assert_eq(cfg.kv.device_weight, 1.0);
    cr_assert_eq(cfg.kv.host_weight, 0.75);
    cr_assert_eq(cfg.kv.disk_weight, 0.25);
    cr_assert_eq(cfg.kv.temperature, 0.0);
    cr_assert_eq(cfg.cache_aware.cache_threshold, 0.3);
    cr_assert_eq(cfg.cache_aware.balance_abs_threshold, 64);
    cr_assert_eq(cfg.cache_aware.balance_rel_threshold, 1.5);
    char why[160];
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_OK);
    cr_assert_str_empty(why);
}

/* Make one field of cfg invalid (case numbers of config_validate_rejects_each_bad_field). */
static void spoil(km_policy_config *c, int which)
{
    switch (which) {
    case 0: c->kv.prefill_load_scale = NAN; break;
    case 1: c->kv.prefill_load_scale = -1.0; break;
    case 2: c->kv.device_weight = NAN; break;
    case 3: c->kv.host_weight = -0.25; break;
    case 4: c->kv.disk_weight = INFINITY; break;
    case 5: c->kv.temperature = -0.5; break;
    case 6: c->kv.temperature = NAN; break;
    case 7: c->kv.temperature = INFINITY; break;
    case 8: c->cache_aware.cache_threshold = 1.5; break;
    case 9: c->cache_aware.cache_threshold = -0.1; break;
    case 10: c->cache_aware.cache_threshold = NAN; break;
    case 11: c->cache_aware.balance_rel_threshold = -1.0; break;
    case 12: c->cache_aware.balance_rel_threshold = NAN; break;
    default: c->kind = (km_policy_kind)17; break;
    }
}

Test(policy, config_validate_rejects_each_bad_field, .timeout = 30)
{
    static const struct {
        const char *field; /* the message must name it */
        int which;
    } cases[] = {
        {"kv.prefill_load_scale", 0},       {"kv.prefill_load_scale", 1},
        {"kv.device_weight", 2},            {"kv.host_weight", 3},
        {"kv.disk_weight", 4},              {"kv.temperature", 5},
        {"kv.temperature", 6},              {"kv.temperature", 7},
        {"cache_aware.cache_threshold", 8}, {"cache_aware.cache_threshold", 9},
        {"cache_aware.cache_threshold", 10}, {"cache_aware.balance_rel_threshold", 11},
        {"cache_aware.balance_rel_threshold", 12}, {"policy kind 17", 13},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        km_policy_config cfg;
        km_policy_config_init(&cfg);
        spoil(&cfg, cases[i].which);
        char why[160] = "";
        cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT,
                     "case %zu (%s) accepted", i, cases[i].field);
        cr_assert(strstr(why, cases[i].field), "case %zu: message '%s' does not name %s", i, why,
                  cases[i].field);
        cr_assert(strncmp(why, "KM_ERR_INVALID_ARGUMENT: ", 25) == 0, "message '%s'", why);
        /* a NULL or tiny buffer is fine */
        cr_assert_eq(km_policy_config_validate(&cfg, NULL, 0), KM_ERR_INVALID_ARGUMENT);
        char tiny[4];
        cr_assert_eq(km_policy_config_validate(&cfg, tiny, sizeof tiny), KM_ERR_INVALID_ARGUMENT);
        cr_assert_eq(strlen(tiny), 3);
    }
    /* the edges that are allowed */
    km_policy_config cfg;
    km_policy_config_init(&cfg);
    cfg.cache_aware.cache_threshold = 0.0;
    cr_assert_eq(km_policy_config_validate(&cfg, NULL, 0), KM_OK);
    cfg.cache_aware.cache_threshold = 1.0;
    cfg.kv.prefill_load_scale = 0.0;
    cfg.kv.host_weight = 0.0;
    cr_assert_eq(km_policy_config_validate(&cfg, NULL, 0), KM_OK);
    char why[64];
    cr_assert_eq(km_policy_config_validate(NULL, why, sizeof why), KM_ERR_NULL_POINTER);
    cr_assert(strstr(why, "NULL"));
}

/* Each double field of a `kind` config (at its offset) is refused by name just past `max`, and
 * taken at `max`. */
static void each_refused_past(km_policy_kind kind, const size_t *offsets,
                              const char *const *names, int n, double max)
{
    char why[160] = "";
    for (int f = 0; f < n; f++) {
        km_policy_config cfg = config(kind);
        double *field = (double *)((char *)&cfg + offsets[f]);
        *field = nextafter(max, INFINITY);
        cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT,
                     "%s", names[f]);
        cr_assert(strstr(why, names[f]), "%s", why);
        *field = max;
        cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_OK, "%s", why);
    }
}

/* A kv parameter past KM_POLICY_KV_PARAM_MAX is refused by name: a scale of 1e308 made the costs
 * of uncached workers infinite, and sampling then chose the worst of them every time. At the
 * maximum every cost stays finite and the sampled choice favours the cheapest worker. */
Test(policy, kv_parameters_past_their_maximum_are_refused, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_KV);
    cfg.kv.prefill_load_scale = 1e308;
    cfg.kv.temperature = 0.5;
    char why[160] = "";
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "kv.prefill_load_scale"), "%s", why);
    km_policy_candidate c[3] = {cand(0, 8, 0, 0, 0, 0, 0), cand(1, 0, 0, 0, 0, 0, 0),
                                cand(2, 0, 0, 0, 0, 0, 100000)};
    km_policy_request req = request(8, 16);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_decision d;
    cr_assert_eq(km_policy_decide(&cfg, &st, &req, c, 3, &d, NULL), KM_ERR_INVALID_ARGUMENT);
    static const size_t fields[] = {offsetof(km_policy_config, kv.prefill_load_scale),
                                    offsetof(km_policy_config, kv.device_weight),
                                    offsetof(km_policy_config, kv.host_weight),
                                    offsetof(km_policy_config, kv.disk_weight),
                                    offsetof(km_policy_config, kv.temperature)};
    static const char *const names[] = {"kv.prefill_load_scale", "kv.device_weight",
                                        "kv.host_weight", "kv.disk_weight", "kv.temperature"};
    each_refused_past(KM_POLICY_KV, fields, names, 5, KM_POLICY_KV_PARAM_MAX);
    cfg = config(KM_POLICY_KV);
    cfg.kv.prefill_load_scale = KM_POLICY_KV_PARAM_MAX;
    cfg.kv.temperature = 0.5;
    int hist[3] = {0};
    double costs[3];
    for (int k = 0; k < 1000; k++)
        hist[decide(&cfg, &st, &req, c, 3, costs).chosen]++;
    for (int i = 0; i < 3; i++)
        cr_assert(isfinite(costs[i]), "cost %d is %g", i, costs[i]);
    cr_assert_gt(hist[0], hist[1] + hist[2], "drawn %d / %d / %d", hist[0], hist[1], hist[2]);
}

/* An llmd weight past KM_POLICY_LLMD_WEIGHT_MAX is refused by name: weights of 1e308 made the
 * scores of both workers below infinite, and the tie went by in-flight requests to the worker
 * with its KV a third used over the one with none. At the maximum the scores stay finite and the
 * unused KV wins. */
Test(policy, llmd_weights_past_their_maximum_are_refused, .timeout = 30)
{
    km_policy_candidate c[2] = {cand(1, 8, 0, 0, 5, 0, 0), cand(2, 8, 0, 0, 1, 0, 0)};
    c[1].allocated_blocks = 9000;
    km_policy_request req = request(8, 16);
    km_policy_config cfg = config(KM_POLICY_LLMD);
    cfg.llmd.prefix_weight = cfg.llmd.queue_weight = cfg.llmd.kv_usage_weight = 1e308;
    char why[160] = "";
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "llmd.prefix_weight"), "%s", why);
    static const size_t fields[] = {offsetof(km_policy_config, llmd.prefix_weight),
                                    offsetof(km_policy_config, llmd.queue_weight),
                                    offsetof(km_policy_config, llmd.kv_usage_weight)};
    static const char *const names[] = {"llmd.prefix_weight", "llmd.queue_weight",
                                        "llmd.kv_usage_weight"};
    each_refused_past(KM_POLICY_LLMD, fields, names, 3, KM_POLICY_LLMD_WEIGHT_MAX);
    cfg = config(KM_POLICY_LLMD);
    cfg.llmd.prefix_weight = cfg.llmd.queue_weight = KM_POLICY_LLMD_WEIGHT_MAX;
    cfg.llmd.kv_usage_weight = KM_POLICY_LLMD_WEIGHT_MAX;
    km_policy_state st;
    km_policy_state_init(&st, 1);
    double costs[2];
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert(isfinite(costs[0]) && isfinite(costs[1]), "scores %g, %g", costs[0], costs[1]);
    cr_assert_eq(d.chosen, 0, "scores %g, %g", costs[0], costs[1]);
}

Test(policy, kind_and_reason_names, .timeout = 30)
{
    const char *kinds[] = {"kv",          "cache_aware", "prefix", "least_load",
                           "round_robin", "llmd",        "preble", "ttft"};
    cr_assert_eq(KM_POLICY_KIND_COUNT, sizeof kinds / sizeof kinds[0]);
    for (unsigned k = 0; k < KM_POLICY_KIND_COUNT; k++) {
        cr_assert_str_eq(km_policy_kind_name((km_policy_kind)k), kinds[k]);
        km_policy_kind parsed = (km_policy_kind)99;
        cr_assert_eq(km_policy_kind_parse(kinds[k], &parsed), KM_OK);
        cr_assert_eq(parsed, (km_policy_kind)k);
    }
    km_policy_kind parsed = KM_POLICY_PREFIX;
    cr_assert_eq(km_policy_kind_parse("KV", &parsed), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_kind_parse("", &parsed), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_kind_parse("kv ", &parsed), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(parsed, KM_POLICY_PREFIX, "failed parse must not write");
    cr_assert_eq(km_policy_kind_parse(NULL, &parsed), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_policy_kind_parse("kv", NULL), KM_ERR_NULL_POINTER);
    cr_assert_str_eq(km_policy_kind_name(KM_POLICY_KIND_COUNT), "unknown");

    const char *reasons[] = {"min_cost",    "sampled",   "cache_hit", "imbalance", "below_threshold",
                             "deepest_match", "no_match", "least_load", "round_robin", "max_score",
                             "exploit",     "explore",   "min_ttft",  "spread",    "warm_up"};
    cr_assert_eq(KM_POLICY_REASON_COUNT, sizeof reasons / sizeof reasons[0]);
    for (unsigned r = 0; r < KM_POLICY_REASON_COUNT; r++)
        cr_assert_str_eq(km_policy_reason_name((km_policy_reason)r), reasons[r]);
    cr_assert_str_eq(km_policy_reason_name((km_policy_reason)42), "unknown");

    km_policy_candidate c = cand(3, 0, 0, 0, 7, 100, 12);
    cr_assert_str_eq(km_policy_load_kind(KM_POLICY_KV), "active_decode_blocks");
    cr_assert_eq(km_policy_load_value(KM_POLICY_KV, &c), 12.0);
    cr_assert_str_eq(km_policy_load_kind(KM_POLICY_CACHE_AWARE), "in_flight_requests");
    cr_assert_eq(km_policy_load_value(KM_POLICY_CACHE_AWARE, &c), 7.0);
    cr_assert_eq(km_policy_load_value(KM_POLICY_LEAST_LOAD, &c), 7.0);
    cr_assert_eq(km_policy_load_value(KM_POLICY_PREFIX, &c), 7.0);
    cr_assert_str_eq(km_policy_load_kind(KM_POLICY_ROUND_ROBIN), "none");
    /* round_robin weighs no load: NAN (null in a record), never a measured 0 */
    cr_assert(isnan(km_policy_load_value(KM_POLICY_ROUND_ROBIN, &c)), "round_robin load value %g",
              km_policy_load_value(KM_POLICY_ROUND_ROBIN, &c));
    cr_assert_eq(km_policy_load_value(KM_POLICY_KV, NULL), 0.0);
}

/* The row of a markdown table in `path` whose first cell is `cell` (e.g. "| `reason` |"), or "". */
static void doc_row(const char *path, const char *cell, char *row, size_t size)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s: run the tests from the repository root", path);
    row[0] = '\0';
    char line[4096];
    while (fgets(line, sizeof line, f))
        if (strncmp(line, cell, strlen(cell)) == 0) {
            snprintf(row, size, "%s", line);
            break;
        }
    fclose(f);
    cr_assert(row[0], "%s has no row %s", path, cell);
}

/* An analyzer is written from the docs: every reason and load kind the code can emit is named, in
 * backquotes, in the field tables of RECORDS.md and PROTOCOL.md. */
Test(policy, every_reason_and_load_kind_is_documented, .timeout = 10)
{
    static const struct {
        const char *path, *reason_cell, *kind_cell;
    } docs[] = {{"docs/RECORDS.md", "| `reason` |", "| `load.kind` |"},
                {"docs/PROTOCOL.md", "| `reason` |", "| `load_kind` |"}};
    char row[4096], name[64];
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        doc_row(docs[i].path, docs[i].reason_cell, row, sizeof row);
        for (unsigned r = 0; r < KM_POLICY_REASON_COUNT; r++) {
            snprintf(name, sizeof name, "`%s`", km_policy_reason_name((km_policy_reason)r));
            cr_assert(strstr(row, name), "%s: reason %s is not documented", docs[i].path, name);
        }
        doc_row(docs[i].path, docs[i].kind_cell, row, sizeof row);
        for (unsigned k = 0; k < KM_POLICY_KIND_COUNT; k++) {
            snprintf(name, sizeof name, "`%s`", km_policy_load_kind((km_policy_kind)k));
            cr_assert(strstr(row, name), "%s: load kind %s is not documented", docs[i].path, name);
        }
    }
}

/* ---- bad input ------------------------------------------------------------------------------ */

/* A failed decide must leave out, costs and the state (except last_error) as they were, and say
 * what was wrong. */
static void expect_rejected(const km_policy_config *cfg, const km_policy_request *req,
                            const km_policy_candidate *c, uint32_t n, int status,
                            const char *needle)
{
    km_policy_state st;
    km_policy_state_init(&st, 1234);
    st.round_robin_cursor = 5;
    km_policy_decision d;
    memset(&d, 0xAB, sizeof d);
    double costs[8];
    for (int i = 0; i < 8; i++)
        costs[i] = -7.0;
    int rc = km_policy_decide(cfg, &st, req, c, n, &d, costs);
    cr_assert_eq(rc, status, "expected %s, got %s (%s)", km_error_name(status), km_error_name(rc),
                 km_policy_last_error(&st));
    const char *why = km_policy_last_error(&st);
    cr_assert(strncmp(why, km_error_name(status), strlen(km_error_name(status))) == 0,
              "message '%s' does not start with the code", why);
    cr_assert(strstr(why, needle), "message '%s' does not mention '%s'", why, needle);
    unsigned char *bytes = (unsigned char *)&d;
    for (size_t i = 0; i < sizeof d; i++)
        cr_assert_eq(bytes[i], 0xAB, "decision written on failure");
    for (int i = 0; i < 8; i++)
        cr_assert_eq(costs[i], -7.0, "costs written on failure");
    cr_assert_eq(st.round_robin_cursor, 5);
    cr_assert_eq(st.rng_state, 1234);
}

Test(policy, bad_input_gets_a_code_and_a_sentence, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_ROUND_ROBIN);
    km_policy_request req = request(4, 16);
    km_policy_candidate ok[2] = {cand(0, 2, 1, 0, 0, 0, 0), cand(1, 0, 0, 0, 0, 0, 0)};

    expect_rejected(&cfg, &req, ok, 0, KM_ERR_INVALID_ARGUMENT, "no candidate");

    km_policy_request zero_bs = request(4, 0);
    expect_rejected(&cfg, &zero_bs, ok, 2, KM_ERR_BLOCK_SIZE, "block_size");

    km_policy_candidate deep[2] = {ok[0], cand(9, 5, 0, 0, 0, 0, 0)};
    expect_rejected(&cfg, &req, deep, 2, KM_ERR_INVALID_ARGUMENT, "depth 5 exceeds");
    expect_rejected(&cfg, &req, deep, 2, KM_ERR_INVALID_ARGUMENT, "worker 9");

    km_policy_candidate split[2] = {ok[0], ok[1]};
    split[1].depth = 3;
    split[1].device_blocks = 1;
    split[1].disk_blocks = 1;
    expect_rejected(&cfg, &req, split, 2, KM_ERR_INVALID_ARGUMENT, "does not add up to depth 3");

    km_policy_request short_prompt = request(4, 16);
    short_prompt.prompt_tokens = 63;
    expect_rejected(&cfg, &short_prompt, ok, 2, KM_ERR_INVALID_ARGUMENT, "prompt_tokens 63");

    km_policy_config bad = config(KM_POLICY_KV);
    bad.kv.temperature = NAN;
    expect_rejected(&bad, &req, ok, 2, KM_ERR_INVALID_ARGUMENT, "kv.temperature");
    /* a bad field of another policy is still refused (config files fail early) */
    bad = config(KM_POLICY_LEAST_LOAD);
    bad.cache_aware.cache_threshold = 2.0;
    expect_rejected(&bad, &req, ok, 2, KM_ERR_INVALID_ARGUMENT, "cache_threshold");

    km_policy_state st;
    km_policy_state_init(&st, 1);
    km_policy_decision d;
    cr_assert_eq(km_policy_decide(NULL, &st, &req, ok, 2, &d, NULL), KM_ERR_NULL_POINTER);
    cr_assert(strstr(km_policy_last_error(&st), "cfg"));
    cr_assert_eq(km_policy_decide(&cfg, &st, NULL, ok, 2, &d, NULL), KM_ERR_NULL_POINTER);
    cr_assert(strstr(km_policy_last_error(&st), "req"));
    cr_assert_eq(km_policy_decide(&cfg, &st, &req, NULL, 2, &d, NULL), KM_ERR_NULL_POINTER);
    cr_assert(strstr(km_policy_last_error(&st), "cands"));
    cr_assert_eq(km_policy_decide(&cfg, &st, &req, ok, 2, NULL, NULL), KM_ERR_NULL_POINTER);
    cr_assert(strstr(km_policy_last_error(&st), "out"));
    cr_assert_eq(km_policy_decide(&cfg, NULL, &req, ok, 2, &d, NULL), KM_ERR_NULL_POINTER);
    cr_assert_str_eq(km_policy_last_error(NULL), "");

    /* a success clears the message; prompt_tokens exactly n_blocks * block_size is fine */
    km_policy_request exact = request(4, 16);
    exact.prompt_tokens = 64;
    cr_assert_eq(km_policy_decide(&cfg, &st, &exact, ok, 2, &d, NULL), KM_OK);
    cr_assert_str_empty(km_policy_last_error(&st));
}

/* ---- best match under the threshold, another worker chosen ---------------------------------- */

Test(policy, owner_and_chosen_are_kept_apart_when_they_differ, .timeout = 30)
{
    /* A holds 2 of 10 blocks (ratio 0.2, under cache_aware's 0.3) and is busier; B holds nothing. */
    km_policy_request req = request(10, 16);
    km_policy_candidate c[2] = {cand(/*A*/ 0, 2, 0, 0, 5, 0, 0), cand(/*B*/ 1, 0, 0, 0, 1, 0, 0)};
    km_policy_config cfg = config(KM_POLICY_CACHE_AWARE);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    double costs[2];
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(d.chosen, 1, "B must be chosen");
    cr_assert_eq(d.owner, 0, "the prediction is about A");
    cr_assert_eq(d.owner_depth, 2);
    cr_assert_eq(d.chosen_depth, 0);
    cr_assert_eq(d.match_ratio, 0.2);
    cr_assert_eq(d.reason, KM_POLICY_REASON_BELOW_THRESHOLD);
    cr_assert_eq(costs[0], 5.0);
    cr_assert_eq(costs[1], 1.0);
    cr_assert_eq(d.chosen_cost, 1.0);

    /* the same split under kv: A's 2 blocks do not pay for its decode load */
    c[0].active_decode_blocks = 40;
    c[1].active_decode_blocks = 10;
    cfg = config(KM_POLICY_KV);
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.owner, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_COST);
    cr_assert_eq(costs[0], 8.0 + 40.0 + 10.0); /* prefill 10 - 2, decode 40 + the request's 10 */
    cr_assert_eq(costs[1], 10.0 + 10.0 + 10.0);
}

/* ---- cache_aware ------------------------------------------------------------------------------ */

/* Worker 0 holds 8 of 10 blocks and has `busy` in flight; worker 1 holds nothing and has `idle`. */
static km_policy_decision cache_aware_pair(uint32_t busy, uint32_t idle)
{
    km_policy_request req = request(10, 16);
    km_policy_candidate c[2] = {cand(0, 8, 0, 0, busy, 0, 0), cand(1, 0, 0, 0, idle, 0, 0)};
    km_policy_config cfg = config(KM_POLICY_CACHE_AWARE);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    return decide(&cfg, &st, &req, c, 2, NULL);
}

Test(policy, cache_aware_abs_threshold_at_and_just_over, .timeout = 30)
{
    /* max - min == 64 is not > 64: balanced, the match wins */
    km_policy_decision d = cache_aware_pair(74, 10);
    cr_assert_eq(d.reason, KM_POLICY_REASON_CACHE_HIT);
    cr_assert_eq(d.chosen, 0);
    /* 65 > 64 and 75 > 10 * 1.5: imbalanced */
    d = cache_aware_pair(75, 10);
    cr_assert_eq(d.reason, KM_POLICY_REASON_IMBALANCE);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.owner, 0, "the owner stays worker 0 when load decides");
}

Test(policy, cache_aware_rel_threshold_at_and_just_over, .timeout = 30)
{
    /* max - min = 100 > 64, but 300 > 200 * 1.5 is false at equality */
    km_policy_decision d = cache_aware_pair(300, 200);
    cr_assert_eq(d.reason, KM_POLICY_REASON_CACHE_HIT);
    d = cache_aware_pair(301, 200);
    cr_assert_eq(d.reason, KM_POLICY_REASON_IMBALANCE);
    cr_assert_eq(d.chosen, 1);
    /* min 0: any max > 64 is imbalanced (max > 0) */
    d = cache_aware_pair(65, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_IMBALANCE);
    d = cache_aware_pair(64, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_CACHE_HIT);
}

Test(policy, cache_aware_cache_threshold_at_and_just_over, .timeout = 30)
{
    km_policy_request req = request(10, 16);
    km_policy_config cfg = config(KM_POLICY_CACHE_AWARE);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    /* 3 / 10 == 0.3 is not > 0.3 */
    km_policy_candidate c[3] = {cand(4, 3, 0, 0, 3, 0, 0), cand(2, 0, 0, 0, 1, 0, 0),
                                cand(1, 0, 0, 0, 1, 0, 0)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 3, NULL);
    cr_assert_eq(d.reason, KM_POLICY_REASON_BELOW_THRESHOLD);
    cr_assert_eq(d.chosen, 2, "least in flight, tie to the lower worker id (1)");
    cr_assert_eq(d.owner, 0);
    c[0] = cand(4, 2, 1, 1, 3, 0, 0); /* 4 / 10: any tier counts for the ratio */
    d = decide(&cfg, &st, &req, c, 3, NULL);
    cr_assert_eq(d.reason, KM_POLICY_REASON_CACHE_HIT);
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.match_ratio, 0.4);
    /* threshold 0 still needs a match (ratio 0 is not > 0) */
    cfg.cache_aware.cache_threshold = 0.0;
    km_policy_candidate none[2] = {cand(5, 0, 0, 0, 2, 0, 0), cand(6, 0, 0, 0, 1, 0, 0)};
    d = decide(&cfg, &st, &req, none, 2, NULL);
    cr_assert_eq(d.reason, KM_POLICY_REASON_BELOW_THRESHOLD);
    cr_assert_eq(d.owner, KM_POLICY_NO_OWNER);
    cr_assert_eq(d.chosen, 1);
    /* an empty request (n_blocks 0) matches nothing */
    km_policy_request empty = request(0, 16);
    d = decide(&cfg, &st, &empty, none, 2, NULL);
    cr_assert_eq(d.match_ratio, 0.0);
    cr_assert_eq(d.chosen, 1);
}

/* ---- kv ------------------------------------------------------------------------------------- */

Test(policy, kv_tier_weights_change_the_choice, .timeout = 30)
{
    /* A holds 8 of 10 blocks, all on disk (credit 8 * 0.25 = 2); B holds 4 on device (credit 4). */
    km_policy_request req = request(10, 16);
    km_policy_candidate c[2] = {cand(0, 0, 0, 8, 0, 0, 0), cand(1, 4, 0, 0, 0, 0, 0)};
    km_policy_config cfg = config(KM_POLICY_KV);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    double costs[2];
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], 8.0 + 10.0);
    cr_assert_eq(costs[1], 6.0 + 10.0);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.owner, 0, "A still owns the deepest match");
    cr_assert_eq(d.owner_depth, 8);
    /* every tier credited fully: A's 8 blocks win */
    cfg.kv.disk_weight = 1.0;
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], 2.0 + 10.0);
    cr_assert_eq(d.chosen, 0);
    /* host blocks at 0.75: 8 host = 6 credit, B's 4 device = 4 */
    c[0] = cand(0, 0, 8, 0, 0, 0, 0);
    cfg = config(KM_POLICY_KV);
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], 4.0 + 10.0);
    cr_assert_eq(d.chosen, 0);
    /* a mixed split: 2 device + 2 host + 4 disk = 2 + 1.5 + 1 = 4.5 */
    c[0] = cand(0, 2, 2, 4, 0, 0, 0);
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], 5.5 + 10.0);
    cr_assert_eq(d.chosen, 0);
}

Test(policy, kv_cost_terms, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_KV);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    double costs[3];
    /* prompt of 70 tokens, 4 full blocks of 16: 70/16 blocks to prefill (Dynamo's isl / B, not
     * rounded), 5 blocks of footprint; 33 output tokens: 3 blocks; pending prefill 17 tokens ->
     * 17/16 of a block, added before the one division */
    km_policy_request req = request(4, 16);
    req.prompt_tokens = 70;
    req.expected_output_tokens = 33;
    km_policy_candidate c[3] = {cand(0, 0, 0, 0, 0, 17, 6), cand(1, 4, 0, 0, 0, 0, 0),
                                cand(2, 1, 0, 0, 0, 16, 0)};
    cfg.kv.prefill_load_scale = 2.0;
    km_policy_decision d = decide(&cfg, &st, &req, c, 3, costs);
    cr_assert_eq(costs[0], 2.0 * (70 + 17) / 16 + (6 + 5 + 3), "%.17g", costs[0]); /* 24.875 */
    cr_assert_eq(costs[1], 2.0 * (70 - 64) / 16 + (0 + 5 + 3), "%.17g", costs[1]); /* 8.75 */
    cr_assert_eq(costs[2], 2.0 * (70 + 16 - 16) / 16 + (0 + 5 + 3), "%.17g", costs[2]);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.chosen_cost, 8.75);
    /* the credit never makes prefill negative */
    cfg.kv.device_weight = 3.0;
    d = decide(&cfg, &st, &req, c, 3, costs);
    cr_assert_eq(costs[1], 0.0 + 8.0);
    /* prefill_load_scale 0: decode load alone */
    cfg.kv.prefill_load_scale = 0.0;
    d = decide(&cfg, &st, &req, c, 3, costs);
    cr_assert_eq(costs[0], 14.0);
    cr_assert_eq(costs[1], 8.0);
    cr_assert_eq(costs[2], 8.0);
    cr_assert_eq(d.chosen, 1, "tie on everything but the worker id -> 1");
}

Test(policy, kv_tie_breaks, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_KV);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(4, 16);
    double costs[2];
    /* equal cost 4 + 10 + 4 = 2 + 12 + 4: fewer active decode blocks wins */
    km_policy_candidate c[2] = {cand(5, 2, 0, 0, 0, 0, 12), cand(9, 0, 0, 0, 3, 0, 10)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], costs[1]);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_COST);
    /* equal cost and decode: fewer in flight */
    c[0] = cand(5, 0, 0, 0, 2, 0, 10);
    c[1] = cand(9, 0, 0, 0, 1, 0, 10);
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(d.chosen, 1);
    /* then the smaller index ("tree size") */
    c[1].in_flight = 2;
    c[0].indexed_blocks = 500;
    c[1].indexed_blocks = 400;
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(d.chosen, 1);
    /* then the lower worker id, whatever the list order */
    c[1].indexed_blocks = 500;
    d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(d.chosen, 0);
    km_policy_candidate swapped[2] = {c[1], c[0]};
    d = decide(&cfg, &st, &req, swapped, 2, costs);
    cr_assert_eq(d.chosen, 1);
    cr_assert_eq(swapped[d.chosen].worker, 5);
    /* temperature 0 never touches the random source */
    cr_assert_eq(st.rng_state, 7);
    cr_assert_eq(st.round_robin_cursor, 0);
}

/* Dynamo's raw_prefill_blocks = (active_prefill_tokens + isl) / B is a real: a worker's pending
 * prefill is not rounded up to a whole block. With every pending count rounded up, 1 and 16
 * pending tokens both cost one block: at scale 1 that tie went to the in_flight tie break (B). */
Test(policy, kv_pending_prefill_is_not_rounded_to_blocks, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_KV);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(4, 16);
    req.prompt_tokens = 64;
    double costs[2];
    /* A: 1 pending token, 3 in flight; B: 16 pending tokens, 1 in flight; equal decode blocks */
    km_policy_candidate c[2] = {cand(0, 0, 0, 0, 3, 1, 10), cand(1, 0, 0, 0, 1, 16, 10)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], (64.0 + 1) / 16 + 10 + 4, "%.17g", costs[0]); /* 18.0625 */
    cr_assert_eq(costs[1], (64.0 + 16) / 16 + 10 + 4, "%.17g", costs[1]); /* 19 */
    cr_assert_eq(d.chosen, 0, "A is 15/16 of a block cheaper");
    cr_assert_eq(d.chosen_cost, 18.0625);
    km_policy_candidate swapped[2] = {c[1], c[0]};
    d = decide(&cfg, &st, &req, swapped, 2, costs);
    cr_assert_eq(swapped[d.chosen].worker, 0);
}

/* The same rounding inverted the order outright at prefill_load_scale 10: A (1 pending token, 5
 * decode blocks) cost 10 * 5 + 9 = 59 against B's (16 pending, 0 decode) 10 * 5 + 4 = 54. */
Test(policy, kv_pending_prefill_fraction_scaled, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_KV);
    cfg.kv.prefill_load_scale = 10.0;
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(4, 16);
    req.prompt_tokens = 64;
    double costs[2];
    km_policy_candidate c[2] = {cand(0, 0, 0, 0, 0, 1, 5), cand(1, 0, 0, 0, 0, 16, 0)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
    cr_assert_eq(costs[0], 10.0 * (64 + 1) / 16 + 5 + 4, "%.17g", costs[0]); /* 49.625 */
    cr_assert_eq(costs[1], 10.0 * (64 + 16) / 16 + 0 + 4, "%.17g", costs[1]); /* 54 */
    cr_assert_eq(d.chosen, 0);
    cr_assert_eq(d.reason, KM_POLICY_REASON_MIN_COST);
}

/* ---- prefix, least_load, round_robin ------------------------------------------------------- */

Test(policy, prefix_deepest_then_load_then_id, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_PREFIX);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(10, 16);
    double costs[4];
    km_policy_candidate c[4] = {cand(0, 3, 0, 0, 0, 0, 0), cand(1, 6, 0, 0, 4, 0, 0),
                                cand(2, 2, 2, 2, 3, 50, 0), cand(3, 6, 0, 0, 3, 40, 0)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 4, costs);
    cr_assert_eq(d.chosen, 3, "depth 6 ties: fewer in flight (3), then fewer pending (40 < 50)");
    cr_assert_eq(d.owner, 3);
    cr_assert_eq(d.reason, KM_POLICY_REASON_DEEPEST_MATCH);
    cr_assert_eq(costs[0], 7.0);
    cr_assert_eq(costs[1], 4.0);
    cr_assert_eq(costs[2], 4.0);
    cr_assert_eq(costs[3], 4.0);
    c[2].pending_prefill_tokens = 40;
    d = decide(&cfg, &st, &req, c, 4, costs);
    cr_assert_eq(c[d.chosen].worker, 2, "all load equal: lower worker id");
    /* nothing matched: least load, no owner */
    km_policy_candidate none[3] = {cand(0, 0, 0, 0, 2, 0, 0), cand(1, 0, 0, 0, 1, 9, 0),
                                   cand(2, 0, 0, 0, 1, 8, 0)};
    d = decide(&cfg, &st, &req, none, 3, costs);
    cr_assert_eq(d.reason, KM_POLICY_REASON_NO_MATCH);
    cr_assert_eq(d.owner, KM_POLICY_NO_OWNER);
    cr_assert_eq(d.chosen, 2);
    cr_assert_eq(d.chosen_cost, 10.0);
}

Test(policy, least_load_order, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_LEAST_LOAD);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(10, 16);
    double costs[4];
    km_policy_candidate c[4] = {cand(8, 9, 0, 0, 1, 5, 5), cand(7, 0, 0, 0, 1, 5, 4),
                                cand(6, 0, 0, 0, 1, 6, 0), cand(5, 0, 0, 0, 2, 0, 0)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 4, costs);
    cr_assert_eq(d.chosen, 1, "in flight 1 ties, pending 5 ties, decode 4 < 5");
    cr_assert_eq(d.owner, 0, "owner is still the deepest match");
    cr_assert_eq(d.reason, KM_POLICY_REASON_LEAST_LOAD);
    cr_assert_eq(costs[3], 2.0);
    c[0].active_decode_blocks = 4;
    d = decide(&cfg, &st, &req, c, 4, costs);
    cr_assert_eq(d.chosen, 1, "full tie: lower worker id (7 < 8)");
}

Test(policy, round_robin_visits_every_candidate_once_per_n_calls, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_ROUND_ROBIN);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    km_policy_request req = request(10, 16);
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (uint32_t n = 1; n <= 17; n++) {
        km_policy_candidate c[17];
        for (uint32_t i = 0; i < n; i++)
            c[i] = cand(100 + i, km_rng_below(&r, 11), 0, 0, km_rng_below(&r, 100),
                        km_rng_below(&r, 1000), km_rng_below(&r, 100));
        uint64_t start = st.round_robin_cursor;
        for (int round = 0; round < 3; round++) {
            uint32_t seen[17] = {0};
            for (uint32_t k = 0; k < n; k++) {
                double costs[17];
                km_policy_decision d = decide(&cfg, &st, &req, c, n, costs);
                cr_assert_eq(d.reason, KM_POLICY_REASON_ROUND_ROBIN);
                /* it compares nothing: no cost at all (null in records), never a measured 0 */
                cr_assert(isnan(d.chosen_cost), "round_robin chosen cost %g", d.chosen_cost);
                for (uint32_t i = 0; i < n; i++)
                    cr_assert(isnan(costs[i]), "round_robin cost %g", costs[i]);
                seen[d.chosen]++;
                /* independent of load: changing load never moves the cursor's pick */
                c[d.chosen].in_flight += 1000;
            }
            for (uint32_t i = 0; i < n; i++)
                KM_CHECK(seen[i] == 1, "n %u round %d: candidate %u chosen %u times", n, round, i,
                         seen[i]);
        }
        cr_assert_eq(st.round_robin_cursor, start + 3 * n);
    }
    cr_assert_eq(st.rng_state, 7);
}

/* ---- property tests against a brute-force oracle ---------------------------------------------- */

/* Oracle: each candidate gets a tuple of integer keys; a full sort (qsort) and the first entry is
 * the answer. kv costs are computed exactly in units of 1/(8 B) block (an eighth of a token) with
 * integer arithmetic, using weights that are multiples of 1/4 and scales that are multiples of
 * 1/2; the prefill is never rounded to whole blocks (Dynamo's raw_prefill_blocks is a real). */
typedef struct okey {
    int64_t k[6];
    uint32_t index;
} okey;

static int okey_cmp(const void *pa, const void *pb)
{
    const okey *a = pa, *b = pb;
    for (int i = 0; i < 6; i++)
        if (a->k[i] != b->k[i])
            return a->k[i] < b->k[i] ? -1 : 1;
    return 0;
}

static uint32_t oracle_first(okey *keys, uint32_t n)
{
    qsort(keys, n, sizeof *keys, okey_cmp);
    return keys[0].index;
}

static void load_keys(okey *o, const km_policy_candidate *c, uint32_t i)
{
    o->k[1] = c->in_flight;
    o->k[2] = (int64_t)c->pending_prefill_tokens;
    o->k[3] = (int64_t)c->active_decode_blocks;
    o->k[4] = c->worker;
    o->k[5] = 0;
    o->index = i;
}

static uint32_t oracle_owner(const km_policy_candidate *c, uint32_t n, okey *keys)
{
    for (uint32_t i = 0; i < n; i++) {
        load_keys(&keys[i], &c[i], i);
        keys[i].k[0] = -(int64_t)c[i].depth;
    }
    uint32_t first = oracle_first(keys, n);
    return c[first].depth ? first : KM_POLICY_NO_OWNER;
}

static uint32_t oracle_least_load(const km_policy_candidate *c, uint32_t n, okey *keys)
{
    for (uint32_t i = 0; i < n; i++) {
        load_keys(&keys[i], &c[i], i);
        keys[i].k[0] = 0;
    }
    return oracle_first(keys, n);
}

static uint32_t oracle_least_in_flight(const km_policy_candidate *c, uint32_t n, okey *keys)
{
    for (uint32_t i = 0; i < n; i++) {
        memset(&keys[i], 0, sizeof keys[i]);
        keys[i].k[0] = c[i].in_flight;
        keys[i].k[1] = c[i].worker;
        keys[i].index = i;
    }
    return oracle_first(keys, n);
}

static int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* kv cost * 8 * B, exactly: weights w4 = weight * 4 (device, host, disk), scale s2 = scale * 2.
 * Prefill is counted in quarter tokens: 4 * (isl + pending) - 4 * credit * B. */
static int64_t oracle_kv_cost8b(const km_policy_request *req, const km_policy_candidate *c,
                                const int64_t w4[3], int64_t s2)
{
    int64_t B = req->block_size;
    int64_t isl = (int64_t)req->n_blocks * B;
    if ((int64_t)req->prompt_tokens > isl)
        isl = (int64_t)req->prompt_tokens;
    int64_t raw4 = 4 * (isl + (int64_t)c->pending_prefill_tokens);
    int64_t credit4 =
        B * (w4[0] * c->device_blocks + w4[1] * c->host_blocks + w4[2] * c->disk_blocks);
    int64_t uncovered4 = raw4 > credit4 ? raw4 - credit4 : 0;
    int64_t request_blocks = req->n_blocks;
    if (div_up((int64_t)req->prompt_tokens, B) > request_blocks)
        request_blocks = div_up((int64_t)req->prompt_tokens, B);
    int64_t decode = (int64_t)c->active_decode_blocks + request_blocks +
                     div_up((int64_t)req->expected_output_tokens, B);
    return s2 * uncovered4 + 8 * B * decode;
}

/* Random candidates with many ties: small value ranges, distinct worker ids. */
static uint32_t random_case(km_rng *r, km_policy_request *req, km_policy_candidate *c,
                            uint32_t max_n)
{
    uint32_t n = 1 + km_rng_below(r, max_n);
    *req = request(km_rng_below(r, 12), 1 + km_rng_below(r, 32));
    if (km_rng_percent(r, 50))
        req->prompt_tokens = (uint64_t)req->n_blocks * req->block_size + km_rng_below(r, 3 * req->block_size);
    if (km_rng_percent(r, 50))
        req->expected_output_tokens = km_rng_below(r, 200);
    uint32_t spread = km_rng_percent(r, 50) ? 3 : 40;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t worker;
        int dup;
        do {
            worker = km_rng_below(r, 4 * max_n);
            dup = 0;
            for (uint32_t j = 0; j < i; j++)
                dup |= c[j].worker == worker;
        } while (dup);
        uint32_t depth = km_rng_percent(r, 30) ? 0 : km_rng_below(r, req->n_blocks + 1);
        uint32_t device = km_rng_below(r, depth + 1);
        uint32_t host = km_rng_below(r, depth - device + 1);
        c[i] = cand(worker, device, host, depth - device - host, km_rng_below(r, spread),
                    km_rng_below(r, spread * req->block_size), km_rng_below(r, spread));
        c[i].indexed_blocks = km_rng_below(r, 3);
    }
    return n;
}

#define PROP_MAX_N 40u
#define PROP_CASES 20000

Test(policy, property_kv_temperature_zero_matches_oracle, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_policy_state st;
    km_policy_state_init(&st, 7);
    static const double scales[] = {0.0, 0.5, 1.0, 2.0, 3.5};
    static const double weights[] = {0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 2.0};
    for (int t = 0; t < PROP_CASES; t++) {
        km_policy_request req;
        km_policy_candidate c[PROP_MAX_N];
        okey keys[PROP_MAX_N];
        double costs[PROP_MAX_N];
        uint32_t n = random_case(&r, &req, c, PROP_MAX_N);
        km_policy_config cfg = config(KM_POLICY_KV);
        if (km_rng_percent(&r, 70)) {
            cfg.kv.prefill_load_scale = scales[km_rng_below(&r, 5)];
            cfg.kv.device_weight = weights[km_rng_below(&r, 7)];
            cfg.kv.host_weight = weights[km_rng_below(&r, 7)];
            cfg.kv.disk_weight = weights[km_rng_below(&r, 7)];
        }
        int64_t w4[3] = {(int64_t)(cfg.kv.device_weight * 4), (int64_t)(cfg.kv.host_weight * 4),
                         (int64_t)(cfg.kv.disk_weight * 4)};
        int64_t s2 = (int64_t)(cfg.kv.prefill_load_scale * 2);
        km_policy_decision d = decide(&cfg, &st, &req, c, n, costs);
        for (uint32_t i = 0; i < n; i++) {
            int64_t cost8b = oracle_kv_cost8b(&req, &c[i], w4, s2);
            double expect = (double)cost8b / (8.0 * req.block_size);
            KM_CHECK(costs[i] == expect, "case %d cand %u: cost %.17g, oracle %.17g", t, i,
                     costs[i], expect);
            keys[i].k[0] = cost8b;
            keys[i].k[1] = (int64_t)c[i].active_decode_blocks;
            keys[i].k[2] = c[i].in_flight;
            keys[i].k[3] = (int64_t)c[i].indexed_blocks;
            keys[i].k[4] = c[i].worker;
            keys[i].k[5] = 0;
            keys[i].index = i;
        }
        uint32_t expect = oracle_first(keys, n);
        KM_CHECK(d.chosen == expect, "case %d: chose %u (worker %u), oracle %u (worker %u)", t,
                 d.chosen, c[d.chosen].worker, expect, c[expect].worker);
        KM_CHECK(d.owner == oracle_owner(c, n, keys), "case %d: owner", t);
        KM_CHECK(d.reason == KM_POLICY_REASON_MIN_COST, "case %d: reason", t);
    }
    cr_assert_eq(st.rng_state, 7);
}

Test(policy, property_prefix_least_load_cache_aware_match_oracle, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x5151);
    km_policy_state st;
    km_policy_state_init(&st, 7);
    for (int t = 0; t < PROP_CASES; t++) {
        km_policy_request req;
        km_policy_candidate c[PROP_MAX_N];
        okey keys[PROP_MAX_N];
        double costs[PROP_MAX_N];
        uint32_t n = random_case(&r, &req, c, PROP_MAX_N);
        uint32_t owner = oracle_owner(c, n, keys);
        uint32_t owner_depth = owner == KM_POLICY_NO_OWNER ? 0 : c[owner].depth;
        uint32_t least = oracle_least_load(c, n, keys);

        km_policy_config cfg = config(KM_POLICY_PREFIX);
        km_policy_decision d = decide(&cfg, &st, &req, c, n, costs);
        KM_CHECK(d.owner == owner, "case %d: prefix owner %u, oracle %u", t, d.owner, owner);
        uint32_t expect = owner != KM_POLICY_NO_OWNER ? owner : least;
        KM_CHECK(d.chosen == expect, "case %d: prefix chose %u, oracle %u", t, d.chosen, expect);
        KM_CHECK(d.reason == (owner != KM_POLICY_NO_OWNER ? KM_POLICY_REASON_DEEPEST_MATCH
                                                          : KM_POLICY_REASON_NO_MATCH),
                 "case %d: prefix reason", t);
        for (uint32_t i = 0; i < n; i++)
            KM_CHECK(costs[i] == (double)(req.n_blocks - c[i].depth), "case %d: prefix cost", t);

        cfg = config(KM_POLICY_LEAST_LOAD);
        d = decide(&cfg, &st, &req, c, n, costs);
        KM_CHECK(d.chosen == least, "case %d: least_load chose %u, oracle %u", t, d.chosen, least);
        KM_CHECK(d.owner == owner, "case %d: least_load owner", t);

        cfg = config(KM_POLICY_CACHE_AWARE);
        cfg.cache_aware.balance_abs_threshold = km_rng_below(&r, 12);
        cfg.cache_aware.balance_rel_threshold = 1.0 + 0.5 * km_rng_below(&r, 3);
        cfg.cache_aware.cache_threshold = 0.1 * km_rng_below(&r, 11);
        d = decide(&cfg, &st, &req, c, n, costs);
        /* oracle: min and max in flight from a sort; the ratio compared as integers */
        for (uint32_t i = 0; i < n; i++) {
            memset(&keys[i], 0, sizeof keys[i]);
            keys[i].k[0] = c[i].in_flight;
            keys[i].index = i;
        }
        qsort(keys, n, sizeof *keys, okey_cmp);
        int64_t lo = keys[0].k[0], hi = keys[n - 1].k[0];
        int imbalanced = hi - lo > (int64_t)cfg.cache_aware.balance_abs_threshold &&
                         2 * hi > lo * (int64_t)(2 * cfg.cache_aware.balance_rel_threshold);
        uint32_t least_if = oracle_least_in_flight(c, n, keys);
        /* ratio > threshold with threshold = k / 10: 10 * depth > k * n_blocks */
        int64_t k10 = (int64_t)llround(cfg.cache_aware.cache_threshold * 10);
        int hit = req.n_blocks > 0 && 10 * (int64_t)owner_depth > k10 * (int64_t)req.n_blocks;
        uint32_t want = imbalanced ? least_if : hit ? owner : least_if;
        km_policy_reason want_reason = imbalanced ? KM_POLICY_REASON_IMBALANCE
                                       : hit      ? KM_POLICY_REASON_CACHE_HIT
                                                  : KM_POLICY_REASON_BELOW_THRESHOLD;
        KM_CHECK(d.chosen == want && d.reason == want_reason,
                 "case %d: cache_aware chose %u (%s), oracle %u (%s); in flight %lld..%lld, "
                 "ratio %u/%u, threshold %.1f",
                 t, d.chosen, km_policy_reason_name(d.reason), want,
                 km_policy_reason_name(want_reason), (long long)lo, (long long)hi, owner_depth,
                 req.n_blocks, cfg.cache_aware.cache_threshold);
        for (uint32_t i = 0; i < n; i++)
            KM_CHECK(costs[i] == (double)c[i].in_flight, "case %d: cache_aware cost", t);
    }
}

/* ---- softmax sampling ------------------------------------------------------------------------- */

/* Five candidates whose kv costs differ: depth 0, 2, 4, 6, 8 of 10 (device), no load. */
static void sampling_case(km_policy_request *req, km_policy_candidate c[5])
{
    *req = request(10, 16);
    for (uint32_t i = 0; i < 5; i++)
        c[i] = cand(20 + i, 2 * i, 0, 0, 0, 0, 0);
}

Test(policy, softmax_sampling_is_deterministic_per_seed, .timeout = 30)
{
    km_policy_request req;
    km_policy_candidate c[5];
    sampling_case(&req, c);
    km_policy_config cfg = config(KM_POLICY_KV);
    cfg.kv.temperature = 1.0;
    uint64_t seed = km_test_seed();
    km_policy_state a, b, other;
    km_policy_state_init(&a, seed);
    km_policy_state_init(&b, seed);
    km_policy_state_init(&other, seed + 1);
    int differ = 0;
    for (int i = 0; i < 2000; i++) {
        km_policy_decision da = decide(&cfg, &a, &req, c, 5, NULL);
        km_policy_decision db = decide(&cfg, &b, &req, c, 5, NULL);
        km_policy_decision dother = decide(&cfg, &other, &req, c, 5, NULL);
        KM_CHECK(da.chosen == db.chosen, "draw %d differs between equal seeds", i);
        cr_assert_eq(da.reason, KM_POLICY_REASON_SAMPLED);
        differ += da.chosen != dother.chosen;
    }
    cr_assert_eq(memcmp(&a, &b, sizeof a), 0);
    KM_CHECK(differ > 100, "seeds %llu and +1 gave nearly the same sequence (%d differences)",
             (unsigned long long)seed, differ);
    /* a copied state replays the same continuation */
    km_policy_state fork = a;
    for (int i = 0; i < 100; i++)
        cr_assert_eq(decide(&cfg, &a, &req, c, 5, NULL).chosen,
                     decide(&cfg, &fork, &req, c, 5, NULL).chosen);
}

/* The test's own probabilities: Dynamo's normalisation, written from the formula. */
static void expected_probabilities(const double *costs, uint32_t n, double temperature, double *p)
{
    double lo = INFINITY, hi = -INFINITY;
    for (uint32_t i = 0; i < n; i++) {
        lo = fmin(lo, costs[i]);
        hi = fmax(hi, costs[i]);
    }
    double z = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        p[i] = hi > lo ? exp((lo - costs[i]) / (hi - lo) / temperature) : 1.0;
        z += p[i];
    }
    for (uint32_t i = 0; i < n; i++)
        p[i] /= z;
}

Test(policy, softmax_frequencies_match_the_probabilities, .timeout = 60)
{
    km_policy_request req;
    km_policy_candidate c[5];
    sampling_case(&req, c);
    static const double temperatures[] = {0.25, 1.0, 4.0};
    for (int ti = 0; ti < 3; ti++) {
        km_policy_config cfg = config(KM_POLICY_KV);
        cfg.kv.temperature = temperatures[ti];
        km_policy_state st;
        km_policy_state_init(&st, km_test_seed() + (uint64_t)ti);
        double costs[5], p[5], lib_p[5];
        enum { DRAWS = 20000 };
        uint32_t count[5] = {0};
        for (int i = 0; i < DRAWS; i++) {
            km_policy_decision d = decide(&cfg, &st, &req, c, 5, costs);
            count[d.chosen]++;
        }
        expected_probabilities(costs, 5, cfg.kv.temperature, p);
        cr_assert_eq(km_policy_softmax_probabilities(costs, 5, cfg.kv.temperature, lib_p), KM_OK);
        double sum = 0.0;
        for (int i = 0; i < 5; i++) {
            cr_assert_float_eq(lib_p[i], p[i], 1e-12);
            sum += lib_p[i];
            double freq = (double)count[i] / DRAWS;
            double sd = sqrt(p[i] * (1.0 - p[i]) / DRAWS);
            KM_CHECK(fabs(freq - p[i]) <= 5.0 * sd + 1e-3,
                     "T %.2f candidate %d: frequency %.4f, probability %.4f (sd %.4f)",
                     cfg.kv.temperature, i, freq, p[i], sd);
        }
        cr_assert_float_eq(sum, 1.0, 1e-12);
        /* lower cost is more likely */
        for (int i = 1; i < 5; i++)
            cr_assert_gt(p[i], p[i - 1]);
    }
}

Test(policy, softmax_tiny_temperature_gives_argmin, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x7777);
    km_policy_state st0, st;
    km_policy_state_init(&st0, 1);
    km_policy_state_init(&st, km_test_seed());
    int compared = 0;
    for (int t = 0; t < 5000; t++) {
        km_policy_request req;
        km_policy_candidate c[PROP_MAX_N];
        double costs[PROP_MAX_N];
        uint32_t n = random_case(&r, &req, c, PROP_MAX_N);
        km_policy_config cfg = config(KM_POLICY_KV);
        km_policy_decision argmin = decide(&cfg, &st0, &req, c, n, costs);
        cfg.kv.temperature = 1e-6;
        km_policy_decision sampled = decide(&cfg, &st, &req, c, n, NULL);
        cr_assert_eq(sampled.reason, KM_POLICY_REASON_SAMPLED);
        /* the draw always lands on a minimum-cost candidate (among tied minima, any) */
        KM_CHECK(sampled.chosen_cost == argmin.chosen_cost, "case %d: sampled cost %.3f, min %.3f",
                 t, sampled.chosen_cost, argmin.chosen_cost);
        uint32_t at_min = 0;
        for (uint32_t i = 0; i < n; i++)
            at_min += costs[i] == argmin.chosen_cost;
        if (at_min == 1) {
            KM_CHECK(sampled.chosen == argmin.chosen, "case %d: unique minimum missed", t);
            compared++;
        }
    }
    cr_assert_gt(compared, 500);
}

Test(policy, softmax_edges, .timeout = 30)
{
    double p[4];
    const double equal[4] = {3.0, 3.0, 3.0, 3.0};
    cr_assert_eq(km_policy_softmax_probabilities(equal, 4, 0.5, p), KM_OK);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(p[i], 0.25);
    const double one[1] = {42.0};
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, 2.0, p), KM_OK);
    cr_assert_eq(p[0], 1.0);
    /* huge temperature: close to uniform; the normalisation makes the scale of costs irrelevant */
    const double spread[2] = {0.0, 1e12};
    cr_assert_eq(km_policy_softmax_probabilities(spread, 2, 1e9, p), KM_OK);
    cr_assert_float_eq(p[0], 0.5, 1e-6);
    const double small[2] = {0.0, 1.0};
    double q[2];
    cr_assert_eq(km_policy_softmax_probabilities(small, 2, 0.7, q), KM_OK);
    cr_assert_eq(km_policy_softmax_probabilities(spread, 2, 0.7, p), KM_OK);
    cr_assert_float_eq(p[0], q[0], 1e-12);
    cr_assert_float_eq(q[0], 1.0 / (1.0 + exp(-1.0 / 0.7)), 1e-12);

    cr_assert_eq(km_policy_softmax_probabilities(one, 0, 1.0, p), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, 0.0, p), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, -1.0, p), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, NAN, p), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, INFINITY, p), KM_ERR_INVALID_ARGUMENT);
    const double bad[2] = {1.0, NAN};
    cr_assert_eq(km_policy_softmax_probabilities(bad, 2, 1.0, p), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_policy_softmax_probabilities(NULL, 1, 1.0, p), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_policy_softmax_probabilities(one, 1, 1.0, NULL), KM_ERR_NULL_POINTER);

    /* one candidate, sampling: always it, one draw consumed */
    km_policy_config cfg = config(KM_POLICY_KV);
    cfg.kv.temperature = 1.0;
    km_policy_state st;
    km_policy_state_init(&st, 99);
    km_policy_request req = request(3, 16);
    km_policy_candidate c[1] = {cand(4, 1, 1, 1, 0, 0, 0)};
    km_policy_decision d = decide(&cfg, &st, &req, c, 1, NULL);
    cr_assert_eq(d.chosen, 0);
    cr_assert_neq(st.rng_state, 99);
    /* all candidates equal: uniform among them */
    km_policy_candidate same[4];
    for (uint32_t i = 0; i < 4; i++)
        same[i] = cand(i, 1, 0, 0, 0, 0, 0);
    uint32_t count[4] = {0};
    for (int i = 0; i < 8000; i++)
        count[decide(&cfg, &st, &req, same, 4, NULL).chosen]++;
    for (int i = 0; i < 4; i++)
        KM_CHECK(count[i] > 1700 && count[i] < 2300, "candidate %d drawn %u of 8000", i, count[i]);
}

/* Finite costs whose range passes the largest double (-1e308 to 1e308) still normalise to [0, 1]:
 * finite probabilities that sum to 1, not NaN from inf / inf. */
Test(policy, softmax_over_costs_spanning_past_the_largest_double, .timeout = 10)
{
    const double costs[3] = {-1e308, 1e308, 0.0};
    double p[3];
    cr_assert_eq(km_policy_softmax_probabilities(costs, 3, 1.0, p), KM_OK);
    double w[3] = {1.0, exp(-1.0), exp(-0.5)}, sum = w[0] + w[1] + w[2];
    for (int i = 0; i < 3; i++)
        cr_assert_float_eq(p[i], w[i] / sum, 1e-12, "p[%d] = %g, expected %g", i, p[i],
                           w[i] / sum);
    const double widest[2] = {DBL_MAX, -DBL_MAX};
    cr_assert_eq(km_policy_softmax_probabilities(widest, 2, 0.5, p), KM_OK);
    cr_assert_float_eq(p[0], exp(-2.0) / (1.0 + exp(-2.0)), 1e-12, "p[0] = %g", p[0]);
    cr_assert_float_eq(p[1], 1.0 / (1.0 + exp(-2.0)), 1e-12, "p[1] = %g", p[1]);
}

/* At the largest engine model km_policy_config_validate accepts (every time constant at
 * KM_ENGINE_MODEL_TIME_MAX, every limit at 1) and the largest counts, every policy's costs and its
 * predicted time to first token stay finite, and ttft chooses the idle holder of the prompt over
 * a worker swamped in every count; one past the maximum is refused. */
Test(policy, every_policy_stays_finite_at_the_largest_engine_model, .timeout = 30)
{
    km_policy_config cfg = config(KM_POLICY_TTFT);
    km_engine_model *m = &cfg.engine;
    m->capacity_blocks = m->max_num_batched_tokens = m->max_num_seqs = 1;
    m->step_floor_us = m->token_us = m->prefill_us_per_pair = KM_ENGINE_MODEL_TIME_MAX;
    m->decode_us_per_request = m->decode_us_per_context_token = KM_ENGINE_MODEL_TIME_MAX;
    m->host_load_us_per_block = m->disk_load_us_per_block = KM_ENGINE_MODEL_TIME_MAX;
    char why[192];
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_OK, "%s", why);
    km_policy_request req = request(1000, 16);
    req.prompt_tokens = INT64_MAX;
    req.expected_output_tokens = INT64_MAX;
    km_policy_candidate c[2] = {cand(1, 0, 0, 0, UINT32_MAX, UINT64_MAX, UINT64_MAX),
                                cand(2, 600, 300, 100, 0, 0, 0)};
    c[0].pending_prefill_pairs = c[0].allocated_blocks = c[0].indexed_blocks = UINT64_MAX;
    c[0].prefix_sharers = UINT32_MAX;
    for (int k = 0; k < KM_POLICY_KIND_COUNT; k++) {
        cfg.kind = (km_policy_kind)k;
        km_policy_state st;
        km_policy_state_init(&st, 5);
        double costs[2];
        km_policy_decision d = decide(&cfg, &st, &req, c, 2, costs);
        cr_assert(isfinite(d.chosen_predicted_ttft_ms) && d.chosen_predicted_ttft_ms > 0,
                  "%s: predicted %g ms", km_policy_kind_name(cfg.kind), d.chosen_predicted_ttft_ms);
        for (int i = 0; i < 2 && k != KM_POLICY_ROUND_ROBIN; i++)
            cr_assert(isfinite(costs[i]), "%s: cost %d is %g", km_policy_kind_name(cfg.kind), i,
                      costs[i]);
        if (k == KM_POLICY_TTFT)
            cr_assert_eq(d.chosen, 1, "ttft chose the swamped worker (costs %g, %g)", costs[0],
                         costs[1]);
    }
    m->token_us = 1e306;
    cr_assert_eq(km_policy_config_validate(&cfg, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "token_us"), "%s", why);
}

/* The engine model's predicted time to first token on the chosen candidate, which every policy
 * reports: on an idle worker holding nothing, the model's prefill of the whole prompt; on any
 * candidates, what ttft weighs for the chosen one when it is the only one (no work added over a
 * better-cached candidate). */
Test(policy, every_policy_reports_the_engine_models_ttft_on_its_choice, .timeout = 60)
{
    km_policy_state st;
    km_policy_state_init(&st, 3);
    km_policy_request req = request(64, 16);
    req.prompt_tokens = 64 * 16;
    km_policy_candidate idle = cand(1, 0, 0, 0, 0, 0, 0);
    km_policy_config base = config(KM_POLICY_TTFT);
    km_engine_load none;
    memset(&none, 0, sizeof none);
    uint64_t blocks = (req.prompt_tokens + base.engine.block_size - 1) / base.engine.block_size;
    double expect = km_engine_model_predict_ttft_us(&base.engine, &none, 0, req.prompt_tokens, 0,
                                                    0, blocks, 0) / 1000.0;
    cr_assert_gt(expect, 0.0);
    for (int k = 0; k < KM_POLICY_KIND_COUNT; k++) {
        km_policy_config cfg = config((km_policy_kind)k);
        km_policy_decision d = decide(&cfg, &st, &req, &idle, 1, NULL);
        cr_assert_float_eq(d.chosen_predicted_ttft_ms, expect, 1e-9, "%s: %.17g, expected %.17g",
                           km_policy_kind_name(cfg.kind), d.chosen_predicted_ttft_ms, expect);
    }

    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x77f7);
    for (int t = 0; t < 4000; t++) {
        km_policy_candidate c[PROP_MAX_N];
        uint32_t n = random_case(&r, &req, c, PROP_MAX_N);
        for (uint32_t i = 0; i < n; i++) {
            c[i].queued_depth = c[i].depth + km_rng_below(&r, req.n_blocks - c[i].depth + 1);
            c[i].prefilling = km_rng_below(&r, c[i].in_flight + 1);
            c[i].prefix_sharers = km_rng_below(&r, 3);
            c[i].allocated_blocks = km_rng_below(&r, 200000);
            c[i].pending_prefill_pairs = km_rng_below(&r, 1u << 20);
        }
        km_policy_config cfg = config((km_policy_kind)km_rng_below(&r, KM_POLICY_KIND_COUNT));
        km_policy_decision d = decide(&cfg, &st, &req, c, n, NULL);
        km_policy_decision alone = decide(&base, &st, &req, &c[d.chosen], 1, NULL);
        KM_CHECK(d.chosen_predicted_ttft_ms == alone.chosen_cost &&
                     alone.chosen_predicted_ttft_ms == alone.chosen_cost,
                 "case %d (%s): reported %.17g, ttft's cost of the chosen one alone %.17g", t,
                 km_policy_kind_name(cfg.kind), d.chosen_predicted_ttft_ms, alone.chosen_cost);
        KM_CHECK(d.chosen_predicted_ttft_ms >= 0 && isfinite(d.chosen_predicted_ttft_ms),
                 "case %d: %g", t, d.chosen_predicted_ttft_ms);
    }
}
