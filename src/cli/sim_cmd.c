/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch sim`: replay a workload through a simulated cluster routed by kvmatch, one run per
 * policy, and print them side by side (docs/SIM.md). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stddef.h>

#include <jansson.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"
#include "sim/report.h"
#include "sim/sim.h"

static void sim_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch sim [--workload SHAPE | --trace FILE] [--sweep LOADS] [options]\n"
            "  (--opt VALUE or --opt=VALUE)\n"
            "  --workload SHAPE    built-in workload: chat (default), system_prompt, agent, docqa\n"
            "  --trace FILE        a Mooncake JSONL trace instead\n"
            "  --requests N        replay the first N requests (generator: draw N; default 600)\n"
            "  --ttft-from N       TTFT figures over requests N and later only (the earlier ones\n"
            "                      run as usual and warm the engines; default 0: all)\n"
            "  --load X            arrivals at X times the cluster's capacity (round robin's\n"
            "                      throughput with every request at once, measured first)\n"
            "  --sweep X,Y,...     every policy at every load, one table (and --html)\n"
            "  --time-scale X      arrival times x X instead (0.5 = twice the rate)\n"
            "  --rate R            generator: new sessions or requests per second\n"
            "  --seed N            generator and engines (default 1)\n"
            "  --workers N         simulated engines (default 8)\n"
            "  --engine PRESET     the engines' speed and memory (default %s):",
            KM_ENGINE_MODEL_DEFAULT_PRESET);
    for (size_t i = 0; km_engine_model_preset_name(i); i++)
        fprintf(f, " %s", km_engine_model_preset_name(i));
    fprintf(f,
            "\n"
            "  --capacity BLOCKS   each engine's KV cache in blocks instead of the preset's\n"
            "  --policy-engine PRESET  the engine model the policies assume (default: the\n"
            "                      engines' own)\n"
            "  --policy LIST       comma-separated, or all: kv, cache_aware, prefix, least_load,\n"
            "                      round_robin, llmd, preble, ttft (default: all)\n"
            "  --html FILE         with --load or --sweep: a self-contained report with charts\n"
            "  --zmq               engines publish over ZMQ on loopback (the real subscriber)\n"
            "  --step-delivery     engines publish once per step like vLLM (default: as events happen)\n"
            "  --connect ADDR      route through a running kvmatch serve (needs --zmq)\n"
            "  --records DIR       keep each policy's decision and outcome records there\n"
            "  --approx            workers without event streams: the index learns from its own\n"
            "                      decisions (approximate mode), bounded by each engine's capacity\n"
            "  --approx-dispatch-mb N  the server's --approx-dispatch-max-bytes, in MiB (0: overrides\n"
            "                      teach nothing)\n"
            "  --json              one JSON object instead of the table\n"
            "  --verbose           progress on stderr, with --json too\n"
            "  --instances N       N > 1: every policy in three modes, one kvmatch instance\n"
            "                      (single), N without a cluster (isolated) and N sharing their\n"
            "                      active work over a nats-server started here (shared); ingress\n"
            "                      round robin over the instances (default 1)\n"
            "faults (times in virtual seconds from the first arrival):\n"
            "  --drop-events P[@T] lose this share of engine messages on the wire (from T on)\n"
            "  --cut W:T:D         cut worker W's event stream at T for D seconds\n"
            "  --replay-buffer N   --zmq: messages each engine keeps for replay (default 10000)\n"
            "  --restart-engine W@T  engine W restarts at T: cache lost, seq back to 0\n"
            "  --second-ingress P  this share of requests bypasses kvmatch (invisible load)\n"
            "  --override P        the router sends this share of routed requests to another\n"
            "                      worker than the decision's and reports it\n"
            "  --restart-kvmatch T[:snapshot|:nosnapshot]  stop kvmatch at T and start a new one,\n"
            "                      from the snapshot it wrote (needs --zmq) or empty\n"
            "faults of several instances (--instances N > 1; the shared mode only; repeatable):\n"
            "  --fault kill-instance@T    the last instance stops for good at T\n"
            "  --fault nats-restart@T[+D] nats-server killed at T, started again D later (default 2)\n"
            "  --fault lossy=P            each instance sends no change message in every\n"
            "                             round(1/P) (0 < P <= 2/3)\n");
}

static int compare_loads(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Comma-separated loads into cfg->loads, in increasing order, each once (as km_sim_config_check
 * wants them); 0 on success. Every element is a number: an empty one (",,", a leading or trailing
 * comma) fails. */
static int parse_loads(const char *v, km_sim_config *cfg)
{
    cfg->n_loads = 0;
    for (const char *t = v;; t++) {
        size_t len = strcspn(t, ",");
        double x;
        if (!km_cli_parse_double(t, len, &x) || !(x > 0 && x <= 100) ||
            cfg->n_loads == KM_SIM_MAX_LOADS)
            return -1;
        cfg->loads[cfg->n_loads++] = x;
        t += len;
        if (!*t)
            break;
    }
    qsort(cfg->loads, cfg->n_loads, sizeof cfg->loads[0], compare_loads);
    uint32_t kept = 0;
    for (uint32_t i = 0; i < cfg->n_loads; i++)
        if (kept == 0 || cfg->loads[i] != cfg->loads[kept - 1])
            cfg->loads[kept++] = cfg->loads[i];
    cfg->n_loads = kept;
    return cfg->n_loads ? 0 : -1;
}

/* "T" or "T+D" of --fault nats-restart@T[+D]: two finite numbers, each the whole of its part;
 * *d is left as it is without "+D". */
static bool nats_restart_times(const char *v, double *t, double *d)
{
    char *end;
    strtod(v, &end); /* where T ends; km_cli_parse_double checks it */
    if (!km_cli_parse_double(v, (size_t)(end - v), t))
        return false;
    return !*end || (*end == '+' && km_cli_parse_double(end + 1, strlen(end + 1), d));
}

static void quiet_or_stderr(void *user, const char *line)
{
    if (user)
        fprintf(stderr, "kvmatch sim: %s\n", line);
}

typedef struct row {
    const char *name;
    int kind; /* 0 = u64, 1 = double, 2 = percent of requests */
    size_t offset;
    int digits;
} row;

#define U(f) 0, offsetof(km_sim_result, f), 0
#define D(f, d) 1, offsetof(km_sim_result, f), d

static const row rows[] = {
    {"requests", U(requests)},
    {"routed by kvmatch", U(routed)},
    {"prompt tokens", U(prompt_tokens)},
    {"actual_reused_tokens", U(actual_reused_tokens)},
    {"predicted_reused_tokens", U(predicted_reused_tokens)},
    {"exact_predictions", U(exact_predictions)},
    {"  over (index claimed more)", U(over_predictions)},
    {"  under (index knew less)", U(under_predictions)},
    {"  engine step unpublished", U(pending_at_decision)},
    {"realized as predicted", U(realized_as_predicted)},
    {"  index wrong at decision", U(diff_index_wrong)},
    {"    events not yet delivered", U(diff_not_delivered)},
    {"    events lost", U(diff_lost)},
    {"    placement assumed (approx)", U(diff_assumed)},
    {"  cache changed before run", U(diff_cache_changed)},
    {"  never ran", U(unadmitted)},
    {"owner_not_chosen", U(owner_not_chosen)},
    {"  reuse forgone (tokens)", U(owner_forgone_tokens)},
    {"warm-ups", U(warm_ups)},
    {"  tokens they prefilled", U(warm_up_prefill_tokens)},
    {"  too large for their engine", U(warm_ups_rejected)},
    {"ttft_p50_ms", D(ttft_p50_ms, 1)},
    {"ttft_p99_ms", D(ttft_p99_ms, 1)},
    {"output tokens/s (virtual)", D(output_tokens_per_s, 0)},
    {"makespan_s (virtual)", D(makespan_s, 1)},
    {"load imbalance (max/mean)", D(load_imbalance, 2)},
    {"decisions_per_s (wall)", D(decisions_per_s, 0)},
    {"decision p50 us (wall)", D(decision_p50_us, 0)},
    {"decision p99 us (wall)", D(decision_p99_us, 0)},
    {"bypassed (second ingress)", U(bypassed)},
    {"overridden by the router", U(overridden)},
    {"messages dropped (fault)", U(dropped_messages)},
    {"lost to engine restart", U(lost_to_restart)},
    {"follow-up turns", U(follow_up_turns)},
    {"  before the previous answer", U(turns_before_answer)},
    {"kvmatch restarts", U(kvmatch_restarts)},
    {"recovery windows seen", U(windows_total)},
    {"  decisions inside them", U(decisions_in_windows)},
    {"  exact inside them", U(exact_in_windows)},
    {"cluster-scope decisions", U(cluster_scope_decisions)},
    {"  others' load seen", U(remote_load_seen)},
    {"this-instance decisions", U(this_instance_decisions)},
    {"stale-view decisions", U(stale_view_decisions)},
    {"propagation waits timed out", U(propagation_timeouts)},
    {"cluster gaps detected", U(cluster_lost_messages)},
    {"cluster contributions expired", U(cluster_expired)},
    {"cluster reconnects", U(cluster_reconnects)},
    {"cluster changes not sent", U(cluster_publish_failures)},
    {"reports lost to the kill", U(reports_lost_to_kill)},
    {"decisions counting the killed", U(counting_killed_decisions)},
    {"decisions after faults", U(decisions_after_faults)},
    {"  in the cluster's view", U(cluster_scope_after_faults)},
    {"  counting the killed", U(counting_killed_after_faults)},
    {"route errors", U(route_errors)},
    {"rejected by engines", U(rejected)},
};

/* A figure that may have no sample (NAN): null in the JSON. */
static json_t *json_figure(double v)
{
    return isnan(v) ? json_null() : json_real(v);
}

static json_t *result_json(const km_sim_result *r)
{
    json_t *o = json_object();
    json_object_set_new(o, "policy", json_string(r->policy));
    json_object_set_new(o, "mode", json_string(km_sim_mode_name(r->mode)));
    json_object_set_new(o, "instances", json_integer(r->instances));
    json_object_set_new(o, "cluster_scope_decisions",
                        json_integer((json_int_t)r->cluster_scope_decisions));
    json_object_set_new(o, "remote_load_seen", json_integer((json_int_t)r->remote_load_seen));
    if (r->mode == KM_SIM_MODE_SHARED) {
        json_t *c = json_object();
        json_object_set_new(c, "this_instance_decisions",
                            json_integer((json_int_t)r->this_instance_decisions));
        json_object_set_new(c, "stale_view_decisions",
                            json_integer((json_int_t)r->stale_view_decisions));
        json_object_set_new(c, "propagation_timeouts",
                            json_integer((json_int_t)r->propagation_timeouts));
        json_object_set_new(c, "lost_messages", json_integer((json_int_t)r->cluster_lost_messages));
        json_object_set_new(c, "expired_instances", json_integer((json_int_t)r->cluster_expired));
        json_object_set_new(c, "reconnects", json_integer((json_int_t)r->cluster_reconnects));
        json_object_set_new(c, "publish_failures",
                            json_integer((json_int_t)r->cluster_publish_failures));
        json_object_set_new(c, "reports_lost_to_kill",
                            json_integer((json_int_t)r->reports_lost_to_kill));
        json_object_set_new(c, "counting_killed_decisions",
                            json_integer((json_int_t)r->counting_killed_decisions));
        json_object_set_new(c, "decisions_after_faults",
                            json_integer((json_int_t)r->decisions_after_faults));
        json_object_set_new(c, "cluster_scope_after_faults",
                            json_integer((json_int_t)r->cluster_scope_after_faults));
        json_object_set_new(c, "counting_killed_after_faults",
                            json_integer((json_int_t)r->counting_killed_after_faults));
        json_object_set_new(o, "cluster", c);
    }
    if (r->load > 0)
        json_object_set_new(o, "load", json_real(r->load));
    json_object_set_new(o, "offered_rps", json_real(r->offered_rps));
    json_object_set_new(o, "throughput_rps", json_real(r->throughput_rps));
    json_object_set_new(o, "first_token_rps", json_real(r->first_token_rps));
    json_object_set_new(o, "reused_share", json_real(r->reused_share));
    json_object_set_new(o, "requests", json_integer((json_int_t)r->requests));
    json_object_set_new(o, "routed", json_integer((json_int_t)r->routed));
    json_object_set_new(o, "route_errors", json_integer((json_int_t)r->route_errors));
    json_object_set_new(o, "rejected", json_integer((json_int_t)r->rejected));
    json_object_set_new(o, "prompt_tokens", json_integer((json_int_t)r->prompt_tokens));
    json_object_set_new(o, "output_tokens", json_integer((json_int_t)r->output_tokens));
    json_object_set_new(o, "actual_reused_tokens", json_integer((json_int_t)r->actual_reused_tokens));
    json_object_set_new(o, "predicted_reused_tokens",
                        json_integer((json_int_t)r->predicted_reused_tokens));
    json_object_set_new(o, "exact_predictions", json_integer((json_int_t)r->exact_predictions));
    json_object_set_new(o, "over_predictions", json_integer((json_int_t)r->over_predictions));
    json_object_set_new(o, "under_predictions", json_integer((json_int_t)r->under_predictions));
    json_object_set_new(o, "pending_at_decision", json_integer((json_int_t)r->pending_at_decision));
    json_t *attr = json_object();
    json_object_set_new(attr, "realized_as_predicted",
                        json_integer((json_int_t)r->realized_as_predicted));
    json_object_set_new(attr, "index_wrong_at_decision", json_integer((json_int_t)r->diff_index_wrong));
    json_object_set_new(attr, "events_not_yet_delivered", json_integer((json_int_t)r->diff_not_delivered));
    json_object_set_new(attr, "events_lost", json_integer((json_int_t)r->diff_lost));
    json_object_set_new(attr, "placement_assumed", json_integer((json_int_t)r->diff_assumed));
    json_object_set_new(attr, "cache_changed_before_run",
                        json_integer((json_int_t)r->diff_cache_changed));
    json_object_set_new(attr, "not_run", json_integer((json_int_t)r->unadmitted));
    json_object_set_new(o, "attribution", attr);
    json_object_set_new(o, "owner_not_chosen", json_integer((json_int_t)r->owner_not_chosen));
    json_object_set_new(o, "warm_ups", json_integer((json_int_t)r->warm_ups));
    json_object_set_new(o, "warm_up_prefill_tokens",
                        json_integer((json_int_t)r->warm_up_prefill_tokens));
    json_object_set_new(o, "warm_ups_rejected", json_integer((json_int_t)r->warm_ups_rejected));
    json_object_set_new(o, "bypassed", json_integer((json_int_t)r->bypassed));
    json_object_set_new(o, "overridden", json_integer((json_int_t)r->overridden));
    json_object_set_new(o, "dropped_messages", json_integer((json_int_t)r->dropped_messages));
    json_object_set_new(o, "lost_to_restart", json_integer((json_int_t)r->lost_to_restart));
    json_object_set_new(o, "follow_up_turns", json_integer((json_int_t)r->follow_up_turns));
    json_object_set_new(o, "turns_before_answer",
                        json_integer((json_int_t)r->turns_before_answer));
    json_object_set_new(o, "kvmatch_restarts", json_integer((json_int_t)r->kvmatch_restarts));
    json_object_set_new(o, "owner_forgone_tokens", json_integer((json_int_t)r->owner_forgone_tokens));
    json_object_set_new(o, "ttft_mean_ms", json_figure(r->ttft_mean_ms));
    json_object_set_new(o, "ttft_p50_ms", json_figure(r->ttft_p50_ms));
    json_object_set_new(o, "ttft_p99_ms", json_figure(r->ttft_p99_ms));
    json_t *every = json_object();
    json_object_set_new(every, "ttft_mean_ms", json_figure(r->every_ttft_mean_ms));
    json_object_set_new(every, "ttft_p50_ms", json_figure(r->every_ttft_p50_ms));
    json_object_set_new(every, "ttft_p99_ms", json_figure(r->every_ttft_p99_ms));
    json_object_set_new(o, "every_request", every);
    json_object_set_new(o, "output_tokens_per_s", json_real(r->output_tokens_per_s));
    json_object_set_new(o, "makespan_s", json_real(r->makespan_s));
    json_object_set_new(o, "load_imbalance", json_real(r->load_imbalance));
    json_object_set_new(o, "decisions_per_s", json_real(r->decisions_per_s));
    json_object_set_new(o, "decision_p50_us", json_real(r->decision_p50_us));
    json_object_set_new(o, "decision_p99_us", json_real(r->decision_p99_us));
    json_object_set_new(o, "wall_s", json_real(r->wall_s));
    json_t *win = json_object();
    json_object_set_new(win, "seen", json_integer((json_int_t)r->windows_total));
    json_object_set_new(win, "decisions_inside", json_integer((json_int_t)r->decisions_in_windows));
    json_object_set_new(win, "exact_inside", json_integer((json_int_t)r->exact_in_windows));
    json_object_set_new(win, "exact_outside",
                        json_integer((json_int_t)(r->exact_predictions - r->exact_in_windows)));
    json_object_set_new(win, "decisions_outside",
                        json_integer((json_int_t)(r->routed - r->decisions_in_windows)));
    json_t *list = json_array();
    for (uint32_t i = 0; i < r->n_windows; i++) {
        const km_sim_window *w = &r->windows[i];
        json_t *o2 = json_object();
        json_object_set_new(o2, "worker", json_integer(w->worker));
        json_object_set_new(o2, "state", json_string(w->state));
        json_object_set_new(o2, "start_s", json_real(w->start_s));
        json_object_set_new(o2, "end_s", w->end_s < 0 ? json_null() : json_real(w->end_s));
        json_object_set_new(o2, "decisions", json_integer((json_int_t)w->decisions));
        json_object_set_new(o2, "exact", json_integer((json_int_t)w->exact));
        json_array_append_new(list, o2);
    }
    json_object_set_new(win, "windows", list);
    json_object_set_new(o, "recovery_windows", win);
    return o;
}

static json_t *engine_json(const km_engine_model *m, const char *preset)
{
    json_t *o = json_object();
    json_object_set_new(o, "preset", json_string(preset));
    json_object_set_new(o, "block_size", json_integer(m->block_size));
    json_object_set_new(o, "capacity_blocks", json_integer(m->capacity_blocks));
    json_object_set_new(o, "max_num_batched_tokens", json_integer(m->max_num_batched_tokens));
    json_object_set_new(o, "max_num_seqs", json_integer(m->max_num_seqs));
    json_object_set_new(o, "step_floor_us", json_real(m->step_floor_us));
    json_object_set_new(o, "token_us", json_real(m->token_us));
    json_object_set_new(o, "prefill_us_per_pair", json_real(m->prefill_us_per_pair));
    json_object_set_new(o, "decode_us_per_request", json_real(m->decode_us_per_request));
    json_object_set_new(o, "decode_us_per_context_token", json_real(m->decode_us_per_context_token));
    return o;
}

/* The "policies" array of one mode's results. */
static json_t *policies_json(const km_sim_config *cfg, const km_sim_result *results)
{
    json_t *arr = json_array();
    if (cfg->n_loads) {
        for (uint32_t p = 0; p < cfg->n_policies; p++) {
            json_t *o = json_object();
            json_object_set_new(o, "policy", json_string(cfg->policies[p]));
            json_t *per = json_array();
            for (uint32_t l = 0; l < cfg->n_loads; l++)
                json_array_append_new(per, result_json(&results[l * cfg->n_policies + p]));
            json_object_set_new(o, "loads", per);
            json_array_append_new(arr, o);
        }
    } else {
        for (uint32_t i = 0; i < cfg->n_policies; i++)
            json_array_append_new(arr, result_json(&results[i]));
    }
    return arr;
}

/* modes_results: with several instances, each mode's results (KM_SIM_MODE_SHARED + 1 of them);
 * NULL for one instance. */
/* One mode's results (no loads): a column per policy. */
static void print_table(const km_sim_config *cfg, const km_sim_result *results)
{
    printf("%-30s", "");
    for (uint32_t i = 0; i < cfg->n_policies; i++)
        printf(" %14s", results[i].policy);
    printf("\n");
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        printf("%-30s", rows[k].name);
        for (uint32_t i = 0; i < cfg->n_policies; i++) {
            const char *base = (const char *)&results[i];
            if (rows[k].kind == 0)
                printf(" %14llu", (unsigned long long)*(const uint64_t *)(base + rows[k].offset));
            else if (isnan(*(const double *)(base + rows[k].offset)))
                printf(" %14s", "-"); /* no sample */
            else
                printf(" %14.*f", rows[k].digits, *(const double *)(base + rows[k].offset));
        }
        printf("\n");
    }
    for (uint32_t i = 0; i < cfg->n_policies; i++)
        for (uint32_t k = 0; k < results[i].n_windows; k++) {
            const km_sim_window *w = &results[i].windows[k];
            char end[32] = "open";
            if (w->end_s >= 0)
                snprintf(end, sizeof end, "%.2f s", w->end_s);
            printf("%s: worker %u %s from %.2f s to %s: %llu decisions, %llu exact\n",
                   results[i].policy, w->worker, w->state, w->start_s, end,
                   (unsigned long long)w->decisions, (unsigned long long)w->exact);
        }
}

static void print_json(const km_sim_config *cfg, const km_sim_report *report,
                      km_sim_result *const *modes_results)
{
    const km_sim_summary *sum = report->summary;
    json_t *root = json_object();
    json_t *w = json_object();
    json_object_set_new(w, "source", json_string(cfg->trace_path ? cfg->trace_path : "generator"));
    if (!cfg->trace_path)
        json_object_set_new(w, "shape", json_string(km_sim_shape_name(cfg->generator.shape)));
    json_object_set_new(w, "requests", json_integer((json_int_t)sum->workload.requests));
    json_object_set_new(w, "seed", json_integer((json_int_t)cfg->generator.seed));
    json_object_set_new(w, "time_scale", json_real(cfg->time_scale));
    json_object_set_new(w, "ttft_from", json_integer((json_int_t)cfg->ttft_from));
    json_object_set_new(w, "prompt_mean_tokens", json_real(sum->workload.prompt_mean));
    json_object_set_new(w, "prompt_p50_tokens", json_real(sum->workload.prompt_p50));
    json_object_set_new(w, "prompt_p99_tokens", json_real(sum->workload.prompt_p99));
    json_object_set_new(w, "output_mean_tokens", json_real(sum->workload.output_mean));
    json_object_set_new(w, "reusable_share", json_real(sum->workload.reusable_share));
    json_object_set_new(w, "floor_ttft_p50_ms", json_figure(sum->workload.floor_ttft_p50_ms));
    json_object_set_new(w, "floor_ttft_p99_ms", json_figure(sum->workload.floor_ttft_p99_ms));
    json_object_set_new(w, "arrival_rate_per_s", json_real(sum->workload.arrival_rate_per_s));
    json_object_set_new(root, "workload", w);
    json_object_set_new(root, "workers", json_integer(cfg->workers));
    json_object_set_new(root, "engine", engine_json(&cfg->engine.model, report->engine));
    json_object_set_new(root, "policy_engine",
                        cfg->policy_engine ? json_string(cfg->policy_engine) : json_null());
    json_object_set_new(root, "capacity_blocks", json_integer(cfg->engine.model.capacity_blocks));
    json_object_set_new(root, "block_size", json_integer(cfg->engine.model.block_size));
    json_object_set_new(root, "events", json_string(cfg->approx ? "none (approximate mode)"
                                                    : cfg->zmq  ? "zmq"
                                                                : "in-process"));
    json_object_set_new(root, "delivery",
                        json_string(cfg->step_delivery ? "per step" : "as they happen"));
    json_object_set_new(root, "default_policy", json_string(report->default_policy));
    if (cfg->n_loads) {
        json_object_set_new(root, "capacity_rps", json_real(sum->capacity_rps));
        json_t *loads = json_array(), *floors = json_array();
        for (uint32_t l = 0; l < cfg->n_loads; l++) {
            json_array_append_new(loads, json_real(cfg->loads[l]));
            json_t *f = json_object(), *every = json_object();
            json_object_set_new(f, "load", json_real(cfg->loads[l]));
            json_object_set_new(f, "floor_ttft_p50_ms", json_figure(sum->floor_ttft_p50_ms[l]));
            json_object_set_new(f, "floor_ttft_p99_ms", json_figure(sum->floor_ttft_p99_ms[l]));
            json_object_set_new(every, "floor_ttft_p50_ms",
                                json_figure(sum->every_floor_ttft_p50_ms[l]));
            json_object_set_new(every, "floor_ttft_p99_ms",
                                json_figure(sum->every_floor_ttft_p99_ms[l]));
            json_object_set_new(f, "every_request", every);
            json_array_append_new(floors, f);
        }
        json_object_set_new(root, "loads", loads);
        json_object_set_new(root, "load_floors", floors);
    }
    if (modes_results) {
        json_object_set_new(root, "instances", json_integer(cfg->instances));
        json_t *modes = json_array();
        for (int m = KM_SIM_MODE_SINGLE; m <= KM_SIM_MODE_SHARED; m++) {
            json_t *o = json_object();
            json_object_set_new(o, "mode", json_string(km_sim_mode_name((km_sim_mode)m)));
            json_object_set_new(o, "instances",
                                json_integer(m == KM_SIM_MODE_SINGLE ? 1 : cfg->instances));
            json_object_set_new(o, "policies", policies_json(cfg, modes_results[m]));
            json_array_append_new(modes, o);
        }
        json_object_set_new(root, "modes", modes);
    } else {
        json_object_set_new(root, "policies", policies_json(cfg, report->results));
    }
    char *text = json_dumps(root, JSON_INDENT(2));
    puts(text);
    free(text);
    json_decref(root);
}

int km_cmd_sim(int argc, char **argv)
{
    km_sim_config cfg;
    km_sim_config_init(&cfg);
    bool json = false, verbose = false;
    static char policy_buf[256];
    const char *html = NULL, *engine = KM_ENGINE_MODEL_DEFAULT_PRESET;
    km_sim_shape shape = KM_SIM_SHAPE_CHAT;
    bool have_seed = false, have_rate = false, have_capacity = false, have_workload = false;
    uint64_t seed = 1, capacity = 0;
    double rate = 0;
    uint64_t requests = 0;
    /* Every policy, unless --policy says otherwise. */
    cfg.n_policies = 0;
    for (unsigned k = 0; k < KM_POLICY_KIND_COUNT; k++)
        cfg.policies[cfg.n_policies++] = km_policy_kind_name((km_policy_kind)k);
    enum {
        OPT_JSON = 256, OPT_ZMQ, OPT_APPROX, OPT_STEP_DELIVERY, OPT_VERBOSE, OPT_TRACE, OPT_REQUESTS,
        OPT_TIME_SCALE, OPT_RATE, OPT_SEED, OPT_WORKERS, OPT_CAPACITY, OPT_WORKLOAD, OPT_ENGINE,
        OPT_LOAD, OPT_SWEEP, OPT_HTML, OPT_CONNECT, OPT_RECORDS, OPT_DROP_EVENTS, OPT_CUT,
        OPT_RESTART_ENGINE, OPT_RESTART_KVMATCH, OPT_SECOND_INGRESS, OPT_OVERRIDE,
        OPT_APPROX_DISPATCH_MB, OPT_REPLAY_BUFFER, OPT_POLICY, OPT_INSTANCES, OPT_FAULT,
        OPT_POLICY_ENGINE, OPT_TTFT_FROM,
    };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"zmq", no_argument, NULL, OPT_ZMQ},
        {"approx", no_argument, NULL, OPT_APPROX},
        {"step-delivery", no_argument, NULL, OPT_STEP_DELIVERY},
        {"verbose", no_argument, NULL, OPT_VERBOSE},
        {"trace", required_argument, NULL, OPT_TRACE},
        {"requests", required_argument, NULL, OPT_REQUESTS},
        {"ttft-from", required_argument, NULL, OPT_TTFT_FROM},
        {"time-scale", required_argument, NULL, OPT_TIME_SCALE},
        {"rate", required_argument, NULL, OPT_RATE},
        {"seed", required_argument, NULL, OPT_SEED},
        {"workers", required_argument, NULL, OPT_WORKERS},
        {"capacity", required_argument, NULL, OPT_CAPACITY},
        {"workload", required_argument, NULL, OPT_WORKLOAD},
        {"engine", required_argument, NULL, OPT_ENGINE},
        {"policy-engine", required_argument, NULL, OPT_POLICY_ENGINE},
        {"load", required_argument, NULL, OPT_LOAD},
        {"sweep", required_argument, NULL, OPT_SWEEP},
        {"html", required_argument, NULL, OPT_HTML},
        {"connect", required_argument, NULL, OPT_CONNECT},
        {"records", required_argument, NULL, OPT_RECORDS},
        {"drop-events", required_argument, NULL, OPT_DROP_EVENTS},
        {"cut", required_argument, NULL, OPT_CUT},
        {"restart-engine", required_argument, NULL, OPT_RESTART_ENGINE},
        {"restart-kvmatch", required_argument, NULL, OPT_RESTART_KVMATCH},
        {"second-ingress", required_argument, NULL, OPT_SECOND_INGRESS},
        {"override", required_argument, NULL, OPT_OVERRIDE},
        {"approx-dispatch-mb", required_argument, NULL, OPT_APPROX_DISPATCH_MB},
        {"replay-buffer", required_argument, NULL, OPT_REPLAY_BUFFER},
        {"policy", required_argument, NULL, OPT_POLICY},
        {"instances", required_argument, NULL, OPT_INSTANCES},
        {"fault", required_argument, NULL, OPT_FAULT},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "sim");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        const char *v = optarg;
        switch (opt) {
        case 'h':
            sim_usage(stdout);
            return KM_EXIT_OK;
        case OPT_JSON:
            json = true;
            break;
        case OPT_ZMQ:
            cfg.zmq = true;
            break;
        case OPT_APPROX:
            cfg.approx = true;
            break;
        case OPT_STEP_DELIVERY:
            cfg.step_delivery = true;
            break;
        case OPT_VERBOSE:
            verbose = true;
            break;
        case OPT_TRACE:
            cfg.trace_path = v;
            break;
        case OPT_REQUESTS:
            if (!km_cli_u64("sim", "requests", v, 1, 10000000, &requests))
                return KM_EXIT_USAGE;
            break;
        case OPT_TTFT_FROM: {
            uint64_t from;
            if (!km_cli_u64("sim", "ttft-from", v, 0, 10000000, &from))
                return KM_EXIT_USAGE;
            cfg.ttft_from = (size_t)from;
            break;
        }
        case OPT_TIME_SCALE:
            if (!km_cli_double("sim", "time-scale", v, 1e-6, 1e6, &cfg.time_scale))
                return KM_EXIT_USAGE;
            break;
        case OPT_RATE:
            if (!km_cli_double("sim", "rate", v, 1e-6, 1e9, &rate))
                return KM_EXIT_USAGE;
            have_rate = true;
            break;
        case OPT_SEED:
            if (!km_cli_u64("sim", "seed", v, 0, UINT64_MAX, &seed))
                return KM_EXIT_USAGE;
            have_seed = true;
            break;
        case OPT_WORKERS:
            if (!km_cli_u32("sim", "workers", v, 1, 4096, &cfg.workers))
                return KM_EXIT_USAGE;
            break;
        case OPT_CAPACITY:
            if (!km_cli_u64("sim", "capacity", v, 1, UINT32_MAX - 1, &capacity))
                return KM_EXIT_USAGE;
            have_capacity = true;
            break;
        case OPT_WORKLOAD:
            if (km_sim_shape_parse(v, &shape) != KM_OK) {
                fprintf(stderr, "kvmatch sim: --workload wants chat, system_prompt, agent or docqa, "
                                "got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            have_workload = true;
            break;
        case OPT_ENGINE:
            if (!km_engine_model_preset_summary(v)) {
                fprintf(stderr, "kvmatch sim: --engine wants a preset (--help lists them), got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            engine = v;
            break;
        case OPT_POLICY_ENGINE:
            if (!km_engine_model_preset_summary(v)) {
                fprintf(stderr, "kvmatch sim: --policy-engine wants a preset (--help lists them), "
                                "got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            cfg.policy_engine = v;
            break;
        case OPT_LOAD:
        case OPT_SWEEP:
            if (parse_loads(v, &cfg) || (opt == OPT_LOAD && (cfg.n_loads != 1 || strchr(v, ',')))) {
                if (opt == OPT_LOAD)
                    fprintf(stderr, "kvmatch sim: --load wants one load in (0, 100], got \"%s\"\n", v);
                else
                    fprintf(stderr, "kvmatch sim: --sweep wants 1..%u comma-separated loads in "
                                    "(0, 100], got \"%s\"\n", KM_SIM_MAX_LOADS, v);
                return KM_EXIT_USAGE;
            }
            break;
        case OPT_HTML:
            html = v;
            break;
        case OPT_CONNECT:
            cfg.connect = v;
            break;
        case OPT_RECORDS:
            cfg.records_dir = v;
            break;
        case OPT_DROP_EVENTS: {
            /* P[@T] */
            const char *at = strchr(v, '@');
            double p, t = 0;
            if (!km_cli_parse_double(v, at ? (size_t)(at - v) : strlen(v), &p) ||
                !(p > 0 && p <= 1) ||
                (at && (!km_cli_parse_double(at + 1, strlen(at + 1), &t) || t < 0))) {
                fprintf(stderr, "kvmatch sim: --drop-events wants P[@T] (0 < P <= 1, T >= 0 "
                                "virtual seconds), got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            cfg.drop_events = p;
            cfg.drop_from_s = t;
            break;
        }
        case OPT_CUT: {
            /* W:T:D */
            const char *c1 = strchr(v, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            uint64_t wk;
            double t, d;
            if (!c2 || !km_cli_parse_u64(v, (size_t)(c1 - v), 4095, &wk) ||
                !km_cli_parse_double(c1 + 1, (size_t)(c2 - c1 - 1), &t) || t < 0 ||
                !km_cli_parse_double(c2 + 1, strlen(c2 + 1), &d) || !(d > 0)) {
                fprintf(stderr, "kvmatch sim: --cut wants WORKER:AT_S:FOR_S (AT_S >= 0, FOR_S > 0 "
                                "virtual seconds), got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            cfg.cut_worker = (int)wk;
            cfg.cut_at_s = t;
            cfg.cut_for_s = d;
            break;
        }
        case OPT_RESTART_ENGINE: {
            /* W@T */
            const char *at = strchr(v, '@');
            uint64_t wk;
            double t;
            if (!at || !km_cli_parse_u64(v, (size_t)(at - v), 4095, &wk) ||
                !km_cli_parse_double(at + 1, strlen(at + 1), &t) || t < 0) {
                fprintf(stderr, "kvmatch sim: --restart-engine wants WORKER@AT_S (AT_S >= 0 "
                                "virtual seconds), got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            cfg.restart_worker = (int)wk;
            cfg.restart_at_s = t;
            break;
        }
        case OPT_RESTART_KVMATCH: {
            /* T[:snapshot|:nosnapshot] */
            const char *colon = strchr(v, ':');
            const char *mode = colon ? colon + 1 : "snapshot";
            double t;
            if (!km_cli_parse_double(v, colon ? (size_t)(colon - v) : strlen(v), &t) || t < 0 ||
                (strcmp(mode, "snapshot") && strcmp(mode, "nosnapshot"))) {
                fprintf(stderr, "kvmatch sim: --restart-kvmatch wants AT_S[:snapshot|:nosnapshot] "
                                "(AT_S >= 0 virtual seconds), got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            cfg.restart_kvmatch_at_s = t;
            cfg.restart_kvmatch_snapshot = !strcmp(mode, "snapshot");
            break;
        }
        case OPT_SECOND_INGRESS:
        case OPT_OVERRIDE: {
            double share;
            if (!km_cli_parse_double(v, strlen(v), &share) || !(share > 0 && share < 1)) {
                fprintf(stderr, "kvmatch sim: --%s wants a share in (0, 1), got \"%s\"\n",
                        opt == OPT_OVERRIDE ? "override" : "second-ingress", v);
                return KM_EXIT_USAGE;
            }
            *(opt == OPT_OVERRIDE ? &cfg.override : &cfg.second_ingress) = share;
            break;
        }
        case OPT_APPROX_DISPATCH_MB: {
            uint64_t mb;
            if (!km_cli_u64("sim", "approx-dispatch-mb", v, 0, UINT64_C(1) << 40, &mb))
                return KM_EXIT_USAGE;
            cfg.approx_dispatch_max_bytes = (int64_t)(mb << 20);
            break;
        }
        case OPT_INSTANCES:
            if (!km_cli_u32("sim", "instances", v, 1, KM_SIM_MAX_INSTANCES, &cfg.instances))
                return KM_EXIT_USAGE;
            break;
        case OPT_FAULT: {
            /* Each number is finite and the whole of its part (km_cli_parse_double); T of
             * nats-restart@T+D ends at the first '+' strtod does not take (1e+3+2: T = 1e+3). */
            static const char kill_at[] = "kill-instance@", nats_at[] = "nats-restart@",
                              lossy_is[] = "lossy=";
            double t, d = cfg.nats_stop_for_s, p;
            if (!strncmp(v, kill_at, sizeof kill_at - 1) &&
                km_cli_parse_double(v + sizeof kill_at - 1, strlen(v + sizeof kill_at - 1), &t) &&
                t >= 0) {
                cfg.kill_instance_at_s = t;
            } else if (!strncmp(v, nats_at, sizeof nats_at - 1) &&
                       nats_restart_times(v + sizeof nats_at - 1, &t, &d) && t >= 0 && d > 0 &&
                       isfinite(t + d)) {
                cfg.nats_stop_at_s = t;
                cfg.nats_stop_for_s = d;
            } else if (!strncmp(v, lossy_is, sizeof lossy_is - 1) &&
                       km_cli_parse_double(v + sizeof lossy_is - 1,
                                           strlen(v + sizeof lossy_is - 1), &p) &&
                       km_sim_cluster_loss_valid(p)) {
                cfg.cluster_loss = p;
            } else {
                fprintf(stderr, "kvmatch sim: --fault \"%s\": kill-instance@T, nats-restart@T[+D] "
                                "(T >= 0, D > 0 virtual seconds) or lossy=P (P in (0, 2/3]; one "
                                "change in every round(1/P) < 2^32 unsent)\n", v);
                return KM_EXIT_USAGE;
            }
            break;
        }
        case OPT_REPLAY_BUFFER:
            if (!km_cli_u32("sim", "replay-buffer", v, 1, 10000000, &cfg.replay_buffer))
                return KM_EXIT_USAGE;
            break;
        case OPT_POLICY:
            if (!strcmp(v, "all"))
                break; /* the default */
            snprintf(policy_buf, sizeof policy_buf, "%s", v);
            cfg.n_policies = 0;
            char *save = NULL;
            for (char *t = strtok_r(policy_buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                km_policy_kind kind;
                if (km_policy_kind_parse(t, &kind) != KM_OK) {
                    fprintf(stderr, "kvmatch sim: --policy %s: unknown policy \"%s\" (all, ttft, "
                                    "kv, cache_aware, prefix, least_load, round_robin, llmd, "
                                    "preble)\n", v, t);
                    return KM_EXIT_USAGE;
                }
                if (cfg.n_policies == KM_SIM_MAX_POLICIES) {
                    fprintf(stderr, "kvmatch sim: --policy names at most %u policies, got \"%s\"\n",
                            KM_SIM_MAX_POLICIES, v);
                    return KM_EXIT_USAGE;
                }
                cfg.policies[cfg.n_policies++] = t;
            }
            if (cfg.n_policies == 0) {
                fprintf(stderr, "kvmatch sim: --policy wants all or comma-separated policy names, "
                                "got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            break;
        default:
            return km_cli_usage_error("sim");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch sim: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("sim");
    }
    /* a fault aimed at a worker the run does not have would inject nothing */
    if (cfg.cut_worker >= 0 && (uint32_t)cfg.cut_worker >= cfg.workers) {
        fprintf(stderr, "kvmatch sim: --cut names worker %d; the workers are 0..%u (--workers %u)\n",
                cfg.cut_worker, cfg.workers - 1, cfg.workers);
        return 2;
    }
    if (cfg.restart_worker >= 0 && (uint32_t)cfg.restart_worker >= cfg.workers) {
        fprintf(stderr, "kvmatch sim: --restart-engine names worker %d; the workers are 0..%u "
                        "(--workers %u)\n",
                cfg.restart_worker, cfg.workers - 1, cfg.workers);
        return 2;
    }
    /* The generator's own settings would be ignored by a trace: a usage error, not a run of
     * another workload than the one asked for. */
    if (cfg.trace_path && (have_workload || have_rate)) {
        fprintf(stderr, "kvmatch sim: --%s sets the built-in generator: it excludes --trace\n",
                have_workload ? "workload" : "rate");
        return KM_EXIT_USAGE;
    }
    km_sim_generator_config_shape(shape, &cfg.generator);
    if (have_seed)
        cfg.generator.seed = seed;
    if (have_rate)
        cfg.generator.rate_per_s = rate;
    if (requests) {
        cfg.max_requests = requests;
        cfg.generator.requests = (uint32_t)requests;
    }
    km_engine_model_preset(engine, &cfg.engine.model);
    cfg.engine_preset = engine;
    if (have_capacity)
        cfg.engine.model.capacity_blocks = (uint32_t)capacity;
    if (html && !cfg.n_loads) {
        fprintf(stderr, "kvmatch sim: --html draws against load: it needs --load or --sweep\n");
        return 2;
    }
    cfg.log = quiet_or_stderr;
    cfg.log_user = verbose || !json ? (void *)1 : NULL;
    uint32_t instances = cfg.instances;
    char why[512];
    if (instances < 2 &&
        (cfg.kill_instance_at_s >= 0 || cfg.nats_stop_at_s >= 0 || cfg.cluster_loss > 0)) {
        fprintf(stderr, "kvmatch sim: --fault kill-instance, nats-restart and lossy act on the "
                        "shared mode: they need --instances N > 1\n");
        return 2;
    }
    if (instances > 1) {
        if (html) {
            fprintf(stderr, "kvmatch sim: --html draws one mode: it excludes --instances > 1\n");
            return 2;
        }
        if (cfg.zmq || cfg.connect || cfg.restart_kvmatch_at_s >= 0) {
            fprintf(stderr, "kvmatch sim: several instances run in this process with in-process "
                            "events: --instances > 1 excludes --zmq, --connect and "
                            "--restart-kvmatch\n");
            return 2;
        }
        /* Before any run: without nats-server the shared mode cannot run, and nothing falls
         * back to the other modes alone. */
        if (!km_sim_shared_available(why, sizeof why)) {
            fprintf(stderr, "kvmatch sim: --instances %u: %s\n", instances, why);
            return 1;
        }
    }
    /* Settings that exclude each other, checked before any run: a usage error, not a failure. */
    for (int m = KM_SIM_MODE_SINGLE; m <= (instances > 1 ? KM_SIM_MODE_SHARED : KM_SIM_MODE_SINGLE);
         m++) {
        cfg.mode = (km_sim_mode)m;
        cfg.instances = m == KM_SIM_MODE_SINGLE ? 1 : instances;
        if (km_sim_config_check(&cfg, why, sizeof why) != KM_OK) {
            fprintf(stderr, "kvmatch sim: %s\n", why);
            return KM_EXIT_USAGE;
        }
    }
    static km_sim_result mode_results[KM_SIM_MODE_SHARED + 1][KM_SIM_MAX_POLICIES * KM_SIM_MAX_LOADS];
    km_sim_result *per_mode[KM_SIM_MODE_SHARED + 1] = {mode_results[0], mode_results[1],
                                                      mode_results[2]};
    km_sim_result *results = mode_results[0];
    km_sim_summary summary;
    int last_mode = instances > 1 ? KM_SIM_MODE_SHARED : KM_SIM_MODE_SINGLE;
    for (int m = KM_SIM_MODE_SINGLE; m <= last_mode; m++) {
        cfg.mode = (km_sim_mode)m;
        cfg.instances = m == KM_SIM_MODE_SINGLE ? 1 : instances;
        if (instances > 1 && (verbose || !json))
            fprintf(stderr, "kvmatch sim: mode %s, %u instance%s\n", km_sim_mode_name(cfg.mode),
                    cfg.instances, cfg.instances == 1 ? "" : "s");
        int rc = km_sim_run(&cfg, mode_results[m], &summary, why, sizeof why);
        if (rc != KM_OK) {
            fprintf(stderr, "kvmatch sim: %s: %s\n", km_error_name(rc), why);
            return 1;
        }
    }
    cfg.mode = KM_SIM_MODE_SINGLE;
    cfg.instances = instances;
    km_policy_config defaults;
    km_policy_config_init(&defaults);
    const char *workload = cfg.trace_path ? cfg.trace_path : km_sim_shape_name(shape);
    km_sim_report report = {&cfg, results, &summary, workload,
                            have_capacity ? "custom" : engine, km_policy_kind_name(defaults.kind)};
    if (html) {
        int rc = km_sim_report_html(&report, html, why, sizeof why);
        if (rc != KM_OK) {
            fprintf(stderr, "kvmatch sim: %s: %s\n", km_error_name(rc), why);
            return 1;
        }
    }
    if (json)
        print_json(&cfg, &report, instances > 1 ? per_mode : NULL);
    for (int m = KM_SIM_MODE_SINGLE; !json && m <= last_mode; m++) {
        if (instances > 1)
            printf("%smode %s (%u instance%s)\n", m == KM_SIM_MODE_SINGLE ? "" : "\n",
                   km_sim_mode_name((km_sim_mode)m), m == KM_SIM_MODE_SINGLE ? 1 : instances,
                   m == KM_SIM_MODE_SINGLE ? "" : "s");
        report.results = mode_results[m];
        if (cfg.n_loads)
            km_sim_report_text(&report, stdout);
        else
            print_table(&cfg, mode_results[m]);
    }
    if (html && !json)
        printf("\nreport: %s\n", html);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvmatch sim: write error\n");
        return KM_EXIT_FAILURE;
    }
    return KM_EXIT_OK;
}
