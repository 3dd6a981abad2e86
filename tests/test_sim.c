/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch sim` (src/sim/sim.h) end to end on small workloads: deterministic per seed and identical
 * whether the engines' events reach kvmatch in process or over ZMQ through the real subscriber;
 * exact predictions when events are delivered as they happen; a lag (only) where a vLLM-like
 * engine publishes once per step; the attribution of predicted against realized reuse adding up;
 * and bad settings refused. Loopback and temporary files only. */
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <criterion/criterion.h>
#include <jansson.h>

#include "analyze/analyze.h"
#include "kvmatch/error.h"
#include "sim/sim.h"
#include "test_util.h"

static void quiet(void *user, const char *line)
{
    (void)user;
    (void)line;
}

static void small_config(km_sim_config *cfg, uint64_t seed)
{
    km_sim_config_init(cfg);
    cfg->generator.seed = seed;
    cfg->generator.requests = 120;
    cfg->workers = 4;
    /* Small caches (64 k tokens each), so placement and eviction matter on a short workload. */
    cfg->engine.model.capacity_blocks = 4096;
    cfg->log = quiet;
}

/* Everything but wall-clock figures. */
static void assert_same(const km_sim_result *a, const km_sim_result *b, const char *what,
                        bool with_windows)
{
    km_sim_result x = *a, y = *b;
    if (!with_windows) {
        /* The transports start differently: over ZMQ a worker is SYNCING until its subscription
         * and bootstrap replay are through, in process until its first message. */
        x.decisions_in_windows = y.decisions_in_windows = 0;
        x.exact_in_windows = y.exact_in_windows = 0;
        x.windows_total = y.windows_total = 0;
        x.n_windows = y.n_windows = 0;
        memset(x.windows, 0, sizeof x.windows);
        memset(y.windows, 0, sizeof y.windows);
    }
    x.decisions_per_s = y.decisions_per_s = 0;
    x.decision_p50_us = y.decision_p50_us = 0;
    x.decision_p99_us = y.decision_p99_us = 0;
    x.wall_s = y.wall_s = 0;
    cr_assert(memcmp(&x, &y, sizeof x) == 0, "%s: policy %s differs (reuse %llu vs %llu, exact %llu vs %llu)",
              what, x.policy, (unsigned long long)x.actual_reused_tokens,
              (unsigned long long)y.actual_reused_tokens, (unsigned long long)x.exact_predictions,
              (unsigned long long)y.exact_predictions);
}

static void check_accounting(const km_sim_result *r)
{
    cr_assert_eq(r->routed + r->route_errors + r->bypassed, r->requests, "%s: every request routed",
                 r->policy);
    cr_assert_eq(r->route_errors, 0, "%s", r->policy);
    cr_assert_eq(r->exact_predictions + r->over_predictions + r->under_predictions, r->routed,
                 "%s: every prediction judged", r->policy);
    cr_assert_eq(r->diff_not_delivered + r->diff_lost + r->diff_assumed, r->diff_index_wrong, "%s",
                 r->policy);
    cr_assert_eq(r->realized_as_predicted + r->diff_index_wrong + r->diff_cache_changed +
                     r->unadmitted,
                 r->routed, "%s: the attribution adds up", r->policy);
    cr_assert_leq(r->actual_reused_tokens, r->prompt_tokens, "%s", r->policy);
    cr_assert_leq(r->owner_not_chosen, r->routed, "%s", r->policy);
}

Test(sim, deterministic_and_the_same_over_zmq, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 11);
    /* The default and the peers whose decisions read load, besides kv. */
    cfg.policies[0] = "ttft";
    cfg.policies[1] = "llmd";
    cfg.policies[2] = "preble";
    cfg.policies[3] = "kv";
    cfg.n_policies = 4;
    km_sim_result a[KM_SIM_MAX_POLICIES], b[KM_SIM_MAX_POLICIES], c[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, a, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(km_sim_run(&cfg, b, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.zmq = true;
    cr_assert_eq(km_sim_run(&cfg, c, NULL, why, sizeof why), KM_OK, "%s", why);
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        assert_same(&a[i], &b[i], "the same seed twice", true);
        assert_same(&a[i], &c[i], "in process vs ZMQ", false);
        check_accounting(&a[i]);
    }
    /* Another seed is another workload. */
    small_config(&cfg, 12);
    cfg.policies[0] = "ttft";
    cr_assert_eq(km_sim_run(&cfg, b, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_neq(a[0].prompt_tokens, b[0].prompt_tokens);
}

Test(sim, exact_when_events_arrive_as_they_happen, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 21);
    /* Pressure: a fast arrival rate and small caches, so engines evict mid-step. */
    cfg.generator.rate_per_s = 40;
    cfg.generator.requests = 250;
    cfg.engine.model.capacity_blocks = 1024;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    uint64_t cache_changed = 0;
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        check_accounting(&r[i]);
        cr_assert_eq(r[i].exact_predictions, r[i].requests,
                     "%s: the index is exact when it hears everything", r[i].policy);
        cr_assert_eq(r[i].diff_index_wrong, 0, "%s", r[i].policy);
        cache_changed += r[i].diff_cache_changed;
    }
    /* Under pressure some caches change between a decision and the request's run. */
    cr_assert_gt(cache_changed, 0);
    /* The same workload with vLLM's once-per-step publishing: the index lags inside a step, and
     * every inexact prediction is one of those. */
    cfg.step_delivery = true;
    km_sim_result s[KM_SIM_MAX_POLICIES];
    cr_assert_eq(km_sim_run(&cfg, s, NULL, why, sizeof why), KM_OK, "%s", why);
    uint64_t inexact = 0;
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        check_accounting(&s[i]);
        uint64_t wrong = s[i].over_predictions + s[i].under_predictions;
        cr_assert_eq(s[i].pending_at_decision, wrong, "%s: inexact only inside a step", s[i].policy);
        inexact += wrong;
    }
    cr_assert_gt(inexact, 0, "step publishing should leave the index behind at least once");
}

static int compare_doubles(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* The records a simulation keeps carry its virtual TTFT on the router's clock (elapsed_ms ->
 * router_ttft_ms): the same values the simulator measured, and what kvmatch analyze reports. */
Test(sim, records_carry_the_simulated_ttft, .timeout = 120)
{
    char dir[] = "/tmp/km-sim-records-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    km_sim_config cfg;
    small_config(&cfg, 31);
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    cfg.records_dir = dir;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    char path[256];
    snprintf(path, sizeof path, "%s/records-kv.jsonl", dir);

    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    double *ttft = calloc(r[0].requests + 1, sizeof *ttft);
    size_t n = 0, outcomes = 0;
    char line[65536];
    while (fgets(line, sizeof line, f)) {
        json_t *rec = json_loads(line, 0, NULL);
        cr_assert_not_null(rec, "a record line is JSON");
        if (!strcmp(json_string_value(json_object_get(rec, "type")), "outcome")) {
            outcomes++;
            json_t *v = json_object_get(rec, "router_ttft_ms");
            cr_assert_not_null(v, "router_ttft_ms is always present");
            cr_assert(json_is_null(json_object_get(rec, "router_dispatched_ms")) == 0,
                      "the sim reports its dispatch time");
            if (!json_is_null(v)) {
                cr_assert_lt(n, r[0].requests);
                ttft[n++] = json_number_value(v);
                cr_assert_geq(json_number_value(json_object_get(rec, "router_e2e_ms")), ttft[n - 1],
                              "finished after the first token");
            }
        }
        json_decref(rec);
    }
    fclose(f);
    cr_assert_eq(outcomes, r[0].routed, "one outcome per routed request");
    cr_assert_gt(n, 0);
    /* The simulator's own percentiles, by its definition (index round(q * (n - 1))). */
    qsort(ttft, n, sizeof *ttft, compare_doubles);
    cr_assert_float_eq(ttft[(size_t)(0.50 * (double)(n - 1) + 0.5)], r[0].ttft_p50_ms, 1e-6);
    cr_assert_float_eq(ttft[(size_t)(0.99 * (double)(n - 1) + 0.5)], r[0].ttft_p99_ms, 1e-6);

    km_analysis *a;
    cr_assert_eq(km_analysis_create(NULL, &a), KM_OK);
    cr_assert_eq(km_analysis_add_file(a, path), KM_OK);
    cr_assert_eq(km_analysis_finish(a), KM_OK);
    const km_analysis_summary *s = km_analysis_summary_get(a);
    cr_assert_eq(s->outcomes.router_ttft_known, s->outcomes.complete);
    cr_assert_eq(s->outcomes.router_ttft_known, n, "every complete outcome had a first token");
    /* analyze uses nearest rank */
    cr_assert_float_eq(s->outcomes.router_ttft_p50_ms, ttft[(n * 50 + 99) / 100 - 1], 1e-9);
    cr_assert_float_eq(s->outcomes.router_ttft_p99_ms, ttft[(n * 99 + 99) / 100 - 1], 1e-9);
    km_analysis_destroy(a);
    free(ttft);
    unlink(path);
    rmdir(dir);
}

Test(sim, cache_aware_routing_reuses_more_than_round_robin, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 31);
    cfg.generator.requests = 200;
    cfg.policies[0] = "kv";
    cfg.policies[1] = "round_robin";
    cfg.n_policies = 2;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_gt(r[0].actual_reused_tokens, r[1].actual_reused_tokens,
                 "kv %llu vs round_robin %llu reused tokens",
                 (unsigned long long)r[0].actual_reused_tokens,
                 (unsigned long long)r[1].actual_reused_tokens);
    cr_assert_lt(r[0].owner_not_chosen, r[1].owner_not_chosen);
}

Test(sim, bad_settings, .timeout = 20)
{
    km_sim_config cfg;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    small_config(&cfg, 1);
    cfg.policies[0] = "fastest";
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "fastest"), "%s", why);
    small_config(&cfg, 1);
    cfg.workers = 0;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    small_config(&cfg, 1);
    cfg.connect = "unix:/tmp/nowhere.sock";
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "--zmq"), "%s", why);
    small_config(&cfg, 1);
    cfg.trace_path = "/nonexistent/trace.jsonl";
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_IO);
    small_config(&cfg, 1);
    cfg.time_scale = 0;
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    small_config(&cfg, 1);
    cfg.engine_preset = "h100-9000";
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "h100-9000"), "%s", why);
}

/* Each fault moves the numbers the way it should (one policy, the same workload each time). */
Test(sim, faults_move_the_numbers, .timeout = 180)
{
    km_sim_config cfg;
    small_config(&cfg, 41);
    cfg.generator.requests = 300;
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    km_sim_result base, drop_local, drop_zmq, restart, bypass;
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, &base, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(base.exact_predictions, base.routed);

    /* Lost messages with no replay (in process): the index misses changes for good. */
    cfg.drop_events = 0.05;
    cr_assert_eq(km_sim_run(&cfg, &drop_local, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&drop_local);
    cr_assert_gt(drop_local.dropped_messages, 0);
    cr_assert_lt(drop_local.exact_predictions, drop_local.routed);
    cr_assert_gt(drop_local.diff_index_wrong, 0);
    cr_assert_gt(drop_local.diff_lost, 0, "in process, what was dropped is lost");
    /* The losses open DEGRADED windows that never close in process (no replay), and the inexact
     * decisions are inside them. */
    bool degraded_open = false;
    for (uint32_t i = 0; i < drop_local.n_windows; i++)
        degraded_open |= !strcmp(drop_local.windows[i].state, "DEGRADED") &&
                         drop_local.windows[i].end_s < 0;
    cr_assert(degraded_open);
    cr_assert_lt(drop_local.exact_in_windows, drop_local.decisions_in_windows);
    cr_assert_eq(drop_local.routed - drop_local.decisions_in_windows,
                 drop_local.exact_predictions - drop_local.exact_in_windows,
                 "outside the windows every prediction is exact");
    /* Without faults the only windows are the engines' first moments (SYNCING), all exact. */
    cr_assert_eq(base.exact_in_windows, base.decisions_in_windows);

    /* The same losses over ZMQ: the subscriber sees the gaps and replay repairs them. */
    cfg.zmq = true;
    cr_assert_eq(km_sim_run(&cfg, &drop_zmq, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&drop_zmq);
    /* The same chance per message; the counts differ where the routes, and so the engines'
     * messages, do. */
    cr_assert_gt(drop_zmq.dropped_messages, 0);
    cr_assert_lt(drop_zmq.routed - drop_zmq.exact_predictions,
                 drop_local.routed - drop_local.exact_predictions,
                 "replay recovers what in-process loss cannot");
    cfg.zmq = false;
    cfg.drop_events = 0;

    /* An engine restart: its running requests fail, and until the new stream reveals the restart
     * the index still claims the old cache. */
    cfg.restart_worker = 0;
    cfg.restart_at_s = 15;
    cr_assert_eq(km_sim_run(&cfg, &restart, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&restart);
    cr_assert_gt(restart.lost_to_restart, 0);
    cr_assert_gt(restart.over_predictions, 0);
    cr_assert_eq(restart.under_predictions, 0);
    cfg.restart_worker = -1;

    /* A second ingress path: its requests are invisible to kvmatch, their blocks are not. */
    cfg.second_ingress = 0.3;
    cr_assert_eq(km_sim_run(&cfg, &bypass, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(bypass.routed + bypass.bypassed, bypass.requests);
    cr_assert_gt(bypass.bypassed, bypass.requests / 5);
    cr_assert_lt(bypass.bypassed, bypass.requests / 2);
    cr_assert_eq(bypass.exact_predictions, bypass.routed, "the index still hears every event");
}

/* Every decision a simulation records carries the engine model's predicted time to first token on
 * the chosen worker (decision.predicted_ttft_ms), every policy's. With arrivals far apart each
 * request meets an idle engine, whose model is the one the simulated engines run: kvmatch analyze
 * finds every prediction equal to the simulated time (within rounding), for a policy that weighs
 * the prediction and for one that does not. */
Test(sim, the_engine_models_prediction_is_the_simulated_ttft_at_leisure, .timeout = 120)
{
    char dir[] = "/tmp/km-sim-predicted-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    km_sim_config cfg;
    small_config(&cfg, 35);
    cfg.time_scale = 50;
    cfg.policies[0] = "ttft";
    cfg.policies[1] = "round_robin";
    cfg.n_policies = 2;
    cfg.records_dir = dir;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    for (int k = 0; k < 2; k++) {
        char path[256];
        snprintf(path, sizeof path, "%s/records-%s.jsonl", dir, cfg.policies[k]);
        km_analysis *a;
        cr_assert_eq(km_analysis_create(NULL, &a), KM_OK);
        cr_assert_eq(km_analysis_add_file(a, path), KM_OK);
        cr_assert_eq(km_analysis_finish(a), KM_OK);
        const km_analysis_summary *s = km_analysis_summary_get(a);
        const km_analysis_ttft_prediction *tp = &s->ttft_prediction;
        cr_assert_eq(s->input.decisions - s->input.warm_ups, r[k].routed);
        cr_assert_eq(tp->decisions_predicted, r[k].routed, "%s: every decision predicts",
                     cfg.policies[k]);
        cr_assert_eq(tp->all.n, s->outcomes.complete);
        cr_assert_eq(tp->router_clock, tp->all.n, "the simulator's clock is the router's");
        cr_assert_gt(tp->all.n, 100);
        cr_assert(tp->all.ratio_p10 >= 0.999 && tp->all.ratio_p90 <= 1.001,
                  "%s: observed / predicted p10 %.6f, p90 %.6f", cfg.policies[k],
                  tp->all.ratio_p10, tp->all.ratio_p90);
        km_analysis_destroy(a);
        unlink(path);
    }
    rmdir(dir);
}

/* What a route tells kvmatch of its answer's length is what a router can know: nothing before any
 * request finished, then the mean output of those that finished before it (rounded), never the
 * answer's own length. A request failed by an engine restart reports no output count (the error
 * outcome), where a completed one reports what it generated. Records are read in the order they
 * were written: every report is with the server before the next decision. */
Test(sim, routes_expect_the_mean_output_seen_so_far, .timeout = 120)
{
    char dir[] = "/tmp/km-sim-expect-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    km_sim_config cfg;
    small_config(&cfg, 33);
    cfg.generator.requests = 300;
    cfg.policies[0] = "ttft";
    cfg.n_policies = 1;
    cfg.records_dir = dir;
    cfg.restart_worker = 0;
    cfg.restart_at_s = 15;
    km_sim_result r[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_gt(r[0].lost_to_restart, 0);
    char path[256];
    snprintf(path, sizeof path, "%s/records-ttft.jsonl", dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    uint64_t sum = 0, finished = 0, decisions = 0, unknown = 0, errors = 0, warm_ups = 0;
    char line[65536];
    while (fgets(line, sizeof line, f)) {
        json_t *rec = json_loads(line, 0, NULL);
        cr_assert_not_null(rec, "a record line is JSON");
        const char *type = json_string_value(json_object_get(rec, "type"));
        /* A warm-up (its attempt id ends ":warm_up") asks for one token nobody reads: neither
         * its decision nor its output counts toward what routes expect. */
        const char *attempt = json_string_value(json_object_get(rec, "attempt_id"));
        if (attempt && strstr(attempt, ":warm_up")) {
            if (!strcmp(type, "decision")) {
                warm_ups++;
                cr_assert(json_is_integer(json_object_get(json_object_get(rec, "decision"),
                                                          "warm_up_for")));
            }
        } else if (!strcmp(type, "decision")) {
            decisions++;
            json_t *e = json_object_get(json_object_get(rec, "prediction"),
                                        "expected_output_tokens");
            if (finished == 0) {
                cr_assert(json_is_null(e), "decision %llu: no answer seen, no expectation",
                          (unsigned long long)decisions);
                unknown++;
            } else {
                cr_assert(json_is_integer(e));
                cr_assert_eq((uint64_t)json_integer_value(e), (sum + finished / 2) / finished,
                             "decision %llu: the mean of %llu finished outputs",
                             (unsigned long long)decisions, (unsigned long long)finished);
            }
        } else if (!strcmp(type, "outcome")) {
            json_t *out = json_object_get(rec, "output_tokens");
            if (!strcmp(json_string_value(json_object_get(rec, "outcome")), "complete")) {
                cr_assert(json_is_integer(out));
                sum += (uint64_t)json_integer_value(out);
                finished++;
            } else {
                cr_assert(json_is_null(out), "a failed request generated no counted output");
                errors++;
            }
        }
        json_decref(rec);
    }
    fclose(f);
    cr_assert_eq(decisions, r[0].routed);
    cr_assert_eq(warm_ups, r[0].warm_ups);
    cr_assert_gt(unknown, 0);
    cr_assert_lt(unknown, decisions, "later decisions have an expectation");
    cr_assert_eq(errors, r[0].lost_to_restart);
}

/* --cut over ZMQ: one worker's messages are lost for 5 s. With a replay buffer longer than the cut
 * the subscriber sees the gap and replay brings everything back (no DEGRADED window, nothing lost);
 * with a shorter one history is gone: the worker goes DEGRADED and stays so, and the removes it
 * missed leave the index claiming blocks the engine evicted (over-predictions). In process there
 * is no replay at all. */
Test(sim, cut_recovers_or_degrades_by_replay_buffer, .timeout = 180)
{
    km_sim_config cfg;
    small_config(&cfg, 42);
    cfg.generator.requests = 400;
    cfg.generator.rate_per_s = 20;
    cfg.engine.model.capacity_blocks = 1024; /* evictions during the cut */
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    cfg.zmq = true;
    cfg.cut_worker = 0;
    cfg.cut_at_s = 10;
    cfg.cut_for_s = 5;
    km_sim_result base, longer, shorter, local;
    char why[512];
    cfg.cut_worker = -1;
    cr_assert_eq(km_sim_run(&cfg, &base, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.cut_worker = 0;
    cfg.replay_buffer = 1000;
    cr_assert_eq(km_sim_run(&cfg, &longer, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_lt(longer.dropped_messages, cfg.replay_buffer, "the cut fits the longer buffer");
    cfg.replay_buffer = 4;
    cr_assert_eq(km_sim_run(&cfg, &shorter, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.zmq = false;
    cr_assert_eq(km_sim_run(&cfg, &local, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&base);
    check_accounting(&longer);
    check_accounting(&shorter);
    check_accounting(&local);
    cr_assert_eq(base.exact_predictions, base.routed);
    cr_assert_gt(longer.dropped_messages, 0);
    cr_assert_eq(shorter.dropped_messages, longer.dropped_messages, "the same cut");

    bool degraded[3] = {false, false, false};
    const km_sim_result *runs[3] = {&longer, &shorter, &local};
    for (int k = 0; k < 3; k++)
        for (uint32_t i = 0; i < runs[k]->n_windows; i++)
            degraded[k] |= runs[k]->windows[i].worker == 0 &&
                           !strcmp(runs[k]->windows[i].state, "DEGRADED") && runs[k]->windows[i].end_s < 0;
    cr_assert_not(degraded[0], "a buffer longer than the cut recovers");
    cr_assert_eq(longer.diff_lost, 0, "replay brought every message back");
    cr_assert(degraded[1], "a buffer shorter than the cut loses history: DEGRADED for good");
    cr_assert(degraded[2], "in process nothing is replayed");
    cr_assert_gt(shorter.over_predictions, 0, "missed removes: the index claims evicted blocks");
    cr_assert_lt(shorter.exact_predictions, longer.exact_predictions);
    cr_assert_gt(shorter.diff_lost, 0, "inexact decisions on the DEGRADED worker count as lost");
}

/* A restart of kvmatch itself, with engines that keep only 500 messages for replay: started empty
 * it cannot rebuild what was stored before (under-predictions); restored from the snapshot it
 * wrote on the way out it resumes from the saved seq + 1 and stays exact. In process (no replay, no
 * saved feed) the loss is larger still. */
Test(sim, kvmatch_restart_with_and_without_snapshot, .timeout = 180)
{
    km_sim_config cfg;
    small_config(&cfg, 41);
    cfg.generator.requests = 300;
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    cfg.zmq = true;
    cfg.replay_buffer = 500;
    cfg.restart_kvmatch_at_s = 15;
    km_sim_result empty, restored, local;
    char why[512];
    cfg.restart_kvmatch_snapshot = false;
    cr_assert_eq(km_sim_run(&cfg, &empty, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.restart_kvmatch_snapshot = true;
    cr_assert_eq(km_sim_run(&cfg, &restored, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.zmq = false;
    cfg.restart_kvmatch_snapshot = false;
    cr_assert_eq(km_sim_run(&cfg, &local, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(empty.kvmatch_restarts, 1);
    cr_assert_eq(restored.kvmatch_restarts, 1);
    check_accounting(&empty);
    check_accounting(&restored);
    check_accounting(&local);
    cr_assert_gt(empty.under_predictions, 0, "history beyond the replay buffer is gone");
    cr_assert_eq(restored.exact_predictions, restored.routed, "the snapshot plus replay is exact");
    cr_assert_gt(local.under_predictions, empty.under_predictions);
    /* The snapshot variant needs ZMQ. */
    cfg.restart_kvmatch_snapshot = true;
    cr_assert_eq(km_sim_run(&cfg, &local, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
}

/* --connect: the simulation drives a separate `kvmatch serve` process (its own pool and workers,
 * added and removed through the protocol), the engines' events reaching it over ZMQ. */
/* A `kvmatch serve` child on a Unix socket in a temporary directory (KM_BIN, else
 * build/kvmatch). */
typedef struct serve_child {
    pid_t pid;
    char dir[64], sock[128], addr[160];
} serve_child;

static void serve_start(serve_child *sc)
{
    const char *bin = getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    cr_assert(access(bin, X_OK) == 0, "%s is not executable (set KM_BIN)", bin);
    snprintf(sc->dir, sizeof sc->dir, "/tmp/kvmatch-simserve-XXXXXX");
    cr_assert_not_null(mkdtemp(sc->dir));
    snprintf(sc->sock, sizeof sc->sock, "%s/s.sock", sc->dir);
    snprintf(sc->addr, sizeof sc->addr, "unix:%s", sc->sock);
    int parent = getpid();
    sc->pid = fork();
    cr_assert(sc->pid >= 0);
    if (sc->pid == 0) {
        km_test_die_with_parent(parent);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0)
            dup2(devnull, 2);
        execl(bin, bin, "serve", "--socket", sc->sock, "--records", "none", "--backend", "cpu",
              (char *)NULL);
        _exit(127);
    }
    struct stat st;
    for (int i = 0; i < 500 && stat(sc->sock, &st) != 0; i++)
        usleep(10000);
}

/* Stops the child; its exit status. */
static int serve_stop(serve_child *sc)
{
    kill(sc->pid, SIGTERM);
    int status = 0;
    waitpid(sc->pid, &status, 0);
    unlink(sc->sock);
    rmdir(sc->dir);
    return status;
}

Test(sim, through_a_running_kvmatch_serve, .timeout = 120)
{
    serve_child sc;
    serve_start(&sc);
    km_sim_config cfg;
    small_config(&cfg, 51);
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    cfg.zmq = true;
    cfg.connect = sc.addr;
    km_sim_result r;
    char why[512];
    int rc = km_sim_run(&cfg, &r, NULL, why, sizeof why);
    int status = serve_stop(&sc);
    cr_assert_eq(rc, KM_OK, "%s", why);
    check_accounting(&r);
    cr_assert_eq(r.exact_predictions, r.routed);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the server exits cleanly");
}

/* The pool a run adds to a running server names the engines' preset, so the policies that time
 * work decide there as they do in process: the same run over --connect and in process. */
Test(sim, a_running_server_times_work_with_the_engines_preset, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 52);
    cr_assert_eq(km_engine_model_preset("llama3-70b-h100x4", &cfg.engine.model), KM_OK);
    cfg.policies[0] = "ttft";
    cfg.n_policies = 1;
    cfg.zmq = true;
    km_sim_result local, remote;
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, &local, NULL, why, sizeof why), KM_OK, "%s", why);
    serve_child sc;
    serve_start(&sc);
    cfg.connect = sc.addr;
    int rc = km_sim_run(&cfg, &remote, NULL, why, sizeof why);
    serve_stop(&sc);
    cr_assert_eq(rc, KM_OK, "%s", why);
    assert_same(&local, &remote, "in process vs a running server", false);
}

/* --policy-engine: the policies assume another engine than the engines run. Naming the engines'
 * own preset changes nothing; the other one changes ttft's decisions (every request still routed
 * and accounted for); an unknown name is refused. */
Test(sim, the_policies_may_assume_another_engine, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 53);
    cfg.generator.requests = 300;
    cr_assert_eq(km_engine_model_preset("llama3-70b-h100x4", &cfg.engine.model), KM_OK);
    cfg.policies[0] = "ttft";
    cfg.n_policies = 1;
    km_sim_result own, named, other;
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, &own, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.policy_engine = "llama3-70b-h100x4";
    cr_assert_eq(km_sim_run(&cfg, &named, NULL, why, sizeof why), KM_OK, "%s", why);
    assert_same(&own, &named, "the engines' own preset named", true);
    cfg.policy_engine = "llama3-8b-h100";
    cr_assert_eq(km_sim_run(&cfg, &other, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&other);
    cr_assert_eq(other.prompt_tokens, own.prompt_tokens, "the same workload");
    cr_assert(other.ttft_p99_ms != own.ttft_p99_ms ||
                  other.actual_reused_tokens != own.actual_reused_tokens ||
                  other.owner_not_chosen != own.owner_not_chosen,
              "the 8B model's costs changed no decision");
    cfg.policy_engine = "h100-9000";
    cr_assert_eq(km_sim_run(&cfg, &other, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "h100-9000"), "%s", why);
}

/* Records of one run: decisions whose prediction source is `source`, and outcomes naming a
 * dispatched_worker. */
static void count_records(const char *path, const char *source, uint64_t *decisions_from_source,
                          uint64_t *decisions, uint64_t *dispatched)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    *decisions_from_source = *decisions = *dispatched = 0;
    char line[65536];
    while (fgets(line, sizeof line, f)) {
        json_t *rec = json_loads(line, 0, NULL);
        cr_assert_not_null(rec, "a record line is JSON");
        const char *type = json_string_value(json_object_get(rec, "type"));
        if (!strcmp(type, "decision")) {
            (*decisions)++;
            const char *src = json_string_value(
                json_object_get(json_object_get(rec, "prediction"), "source"));
            *decisions_from_source += src && !strcmp(src, source);
        } else if (json_is_string(json_object_get(rec, "dispatched_worker"))) {
            const char *dw = json_string_value(json_object_get(rec, "dispatched_worker"));
            const char *chosen = json_string_value(json_object_get(rec, "worker"));
            cr_assert(dw[0] && chosen && strcmp(dw, chosen) != 0,
                      "outcome: dispatched_worker \"%s\", worker %s", dw, chosen ? chosen : "null");
            (*dispatched)++;
        }
        json_decref(rec);
    }
    fclose(f);
}

/* Approximate mode (no event streams) and router overrides. With events the index stays exact
 * even for overridden requests (their prediction is the row of the worker they went to). Without,
 * every decision says `approx`, and the index, which can only assume, is inexact under cache
 * pressure. Overrides reported by the router teach the worker they went to (src/service/attempts.c,
 * lesson_queue): with that, more predictions are exact and fewer under the truth than when the
 * server keeps no hashes for them (approx_dispatch_max_bytes 0), on the identical workload. */
/* Message drops draw from a stream of their own: the number of engine messages depends on the
 * policy, so drops sharing the per-request draws (second ingress, override) would hand each policy
 * another set of bypassed and overridden requests. With drops every policy still gets the very
 * requests it gets without them. */
Test(sim, drops_leave_every_policy_the_same_workload, .timeout = 120)
{
    km_sim_config cfg;
    small_config(&cfg, 43);
    cfg.generator.requests = 300;
    cfg.policies[0] = "kv";
    cfg.policies[1] = "round_robin";
    cfg.policies[2] = "least_load";
    cfg.n_policies = 3;
    cfg.second_ingress = 0.3;
    cfg.override = 0.2;
    km_sim_result clean[KM_SIM_MAX_POLICIES], dropped[KM_SIM_MAX_POLICIES];
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, clean, NULL, why, sizeof why), KM_OK, "%s", why);
    cfg.drop_events = 0.1;
    cr_assert_eq(km_sim_run(&cfg, dropped, NULL, why, sizeof why), KM_OK, "%s", why);
    for (uint32_t i = 0; i < cfg.n_policies; i++) {
        cr_assert_gt(dropped[i].dropped_messages, 0, "%s", dropped[i].policy);
        cr_assert_eq(clean[i].bypassed, clean[0].bypassed, "%s", clean[i].policy);
        cr_assert_eq(clean[i].overridden, clean[0].overridden, "%s", clean[i].policy);
        cr_assert_eq(dropped[i].bypassed, clean[i].bypassed, "%s: bypassed %llu with drops, %llu "
                     "without", dropped[i].policy, (unsigned long long)dropped[i].bypassed,
                     (unsigned long long)clean[i].bypassed);
        cr_assert_eq(dropped[i].overridden, clean[i].overridden, "%s: overridden %llu with drops, "
                     "%llu without", dropped[i].policy, (unsigned long long)dropped[i].overridden,
                     (unsigned long long)clean[i].overridden);
    }
}

/* `rejected` counts every request an engine turned away, whoever sent it there: engines too
 * small for any prompt reject all of them, the second ingress path's too. */
Test(sim, rejected_counts_bypassed_requests_too, .timeout = 60)
{
    km_sim_config cfg;
    small_config(&cfg, 44);
    cfg.generator.requests = 40;
    cfg.workers = 2;
    cfg.engine.model.capacity_blocks = 10; /* 160 tokens: below every prompt of the shape */
    cfg.second_ingress = 0.5;
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    km_sim_result r;
    char why[512];
    cr_assert_eq(km_sim_run(&cfg, &r, NULL, why, sizeof why), KM_OK, "%s", why);
    cr_assert_gt(r.bypassed, 0);
    cr_assert_gt(r.routed, 0);
    cr_assert_eq(r.output_tokens, 0, "no engine ran anything");
    cr_assert_eq(r.rejected, r.requests, "rejected %llu of %llu (routed %llu, bypassed %llu)",
                 (unsigned long long)r.rejected, (unsigned long long)r.requests,
                 (unsigned long long)r.routed, (unsigned long long)r.bypassed);
}

/* A restart time past the run never fires, however large: 1e30 s is no integer microsecond
 * count, and converting it to one fired the restart at once. */
Test(sim, restarts_past_the_run_never_fire, .timeout = 60)
{
    km_sim_config cfg;
    small_config(&cfg, 45);
    cfg.generator.requests = 60;
    cfg.workers = 2;
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    const double times[] = {1e13, 1e30, 1.7e308};
    for (size_t i = 0; i < sizeof times / sizeof times[0]; i++) {
        cfg.restart_worker = 0;
        cfg.restart_at_s = times[i];
        cfg.restart_kvmatch_at_s = times[i];
        cfg.restart_kvmatch_snapshot = false;
        km_sim_result r;
        char why[512];
        cr_assert_eq(km_sim_run(&cfg, &r, NULL, why, sizeof why), KM_OK, "%s", why);
        cr_assert_eq(r.lost_to_restart, 0, "restart at %g s", times[i]);
        cr_assert_eq(r.kvmatch_restarts, 0, "restart at %g s", times[i]);
        cr_assert_eq(r.exact_predictions, r.routed, "restart at %g s", times[i]);
    }
}

Test(sim, approximate_mode_and_router_overrides, .timeout = 120)
{
    char dir[] = "/tmp/km-sim-approx-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    km_sim_config cfg;
    small_config(&cfg, 51);
    cfg.generator.requests = 200;
    cfg.policies[0] = "cache_aware";
    cfg.n_policies = 1;
    cfg.override = 0.3;
    cfg.records_dir = dir;
    char path[256], why[512];
    snprintf(path, sizeof path, "%s/records-cache_aware.jsonl", dir);
    km_sim_result events, taught, untaught;
    uint64_t from_source, decisions, dispatched;
    cr_assert_eq(km_sim_run(&cfg, &events, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&events);
    cr_assert_gt(events.overridden, 0);
    cr_assert_lt(events.overridden, events.routed);
    cr_assert_eq(events.exact_predictions, events.routed, "overridden predictions are exact too");
    count_records(path, "events", &from_source, &decisions, &dispatched);
    cr_assert_eq(from_source, decisions);
    cr_assert_eq(dispatched, events.overridden, "one outcome names each override");
    unlink(path); /* the next run's records alone (the writer appends) */

    cfg.approx = true;
    cr_assert_eq(km_sim_run(&cfg, &taught, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&taught);
    count_records(path, "approx", &from_source, &decisions, &dispatched);
    cr_assert_eq(decisions, taught.routed);
    cr_assert_eq(from_source, decisions, "an approximate-mode decision said events");
    cr_assert_eq(dispatched, taught.overridden);
    cr_assert_lt(taught.exact_predictions, taught.routed, "assumed placement is never this lucky");
    cr_assert_gt(taught.diff_assumed, 0);
    cr_assert_eq(taught.diff_not_delivered + taught.diff_lost, 0, "approximate mode has no events");
    cr_assert_eq(events.diff_assumed, 0);
    /* Deterministic too: approximate mode's TTL and touch times count wall time, which the
     * simulator keeps out of the table (sim.c, start_server). */
    km_sim_result again;
    unlink(path);
    cr_assert_eq(km_sim_run(&cfg, &again, NULL, why, sizeof why), KM_OK, "%s", why);
    assert_same(&taught, &again, "approximate mode twice", true);

    cfg.approx_dispatch_max_bytes = 0;
    cr_assert_eq(km_sim_run(&cfg, &untaught, NULL, why, sizeof why), KM_OK, "%s", why);
    check_accounting(&untaught);
    cr_assert_eq(untaught.overridden, taught.overridden, "the same workload, the same overrides");
    cr_assert_gt(taught.exact_predictions, untaught.exact_predictions,
                 "overrides taught %llu exact, untaught %llu",
                 (unsigned long long)taught.exact_predictions,
                 (unsigned long long)untaught.exact_predictions);
    cr_assert_lt(taught.under_predictions, untaught.under_predictions);
    unlink(path);
    rmdir(dir);

    /* Approximate mode has no stream to fault. */
    small_config(&cfg, 1);
    cfg.approx = true;
    cfg.zmq = true;
    cr_assert_eq(km_sim_run(&cfg, &events, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    small_config(&cfg, 1);
    cfg.approx = true;
    cfg.drop_events = 0.1;
    cr_assert_eq(km_sim_run(&cfg, &events, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    small_config(&cfg, 1);
    cfg.override = 1.0;
    cr_assert_eq(km_sim_run(&cfg, &events, NULL, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
}
