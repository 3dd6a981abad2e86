/* SPDX-License-Identifier: Apache-2.0 */
/* The JSON report of a finished analysis (km_analysis_render_json; docs/ANALYZE.md lists its
 * keys): one object built with jansson from the summary alone. */
#include "analyze/analyze.h"

#include <stdint.h>
#include <stdlib.h>

#include <jansson.h>

static json_t *json_ttft_ratio(const km_analysis_ttft_ratio *r)
{
    return json_pack("{sI sf sf sf sf sf}", "n", (json_int_t)r->n, "ratio_p10", r->ratio_p10,
                     "ratio_p50", r->ratio_p50, "ratio_p90", r->ratio_p90, "observed_p50_ms",
                     r->observed_p50_ms, "predicted_p50_ms", r->predicted_p50_ms);
}

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
    json_t *reasons = json_array();
    for (size_t i = 0; reasons && i < s->n_reasons; i++) {
        const km_analysis_reason *why = &s->reasons[i];
        json_array_append_new(
            reasons, json_pack("{ss so sI sI sI sI}", "policy", why->policy, "reason",
                               *why->reason ? json_string(why->reason) : json_null(), "decisions",
                               (json_int_t)why->decisions, "owner_not_chosen",
                               (json_int_t)why->owner_not_chosen, "owner_not_weighed",
                               (json_int_t)why->owner_not_weighed, "given_up_tokens",
                               (json_int_t)why->given_up_tokens));
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
        "{s{sI sI sI sI sI sI sI sI sI sI}"
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
        (json_int_t)in->outcomes, "warm_ups", (json_int_t)in->warm_ups, "hosts",
        (json_int_t)in->hosts,
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
    if (!root || !reasons || json_object_set_new(root, "reasons", reasons)) {
        json_decref(root);
        return KM_ERR_OUT_OF_MEMORY;
    }
    /* Every figure is finite (km_analysis_ttft_prediction compares finite ratios only): a NULL
     * here is out of memory, never a key left out. */
    const km_analysis_ttft_prediction *tp = &s->ttft_prediction;
    if (json_object_set_new(
            root, "ttft_prediction",
            json_pack("{sI sI sI so so so}", "decisions_predicted",
                      (json_int_t)tp->decisions_predicted, "router_clock",
                      (json_int_t)tp->router_clock, "kvmatch_clock", (json_int_t)tp->kvmatch_clock,
                      "all", json_ttft_ratio(&tp->all), "idle", json_ttft_ratio(&tp->idle),
                      "queued", json_ttft_ratio(&tp->queued)))) {
        json_decref(root);
        return KM_ERR_OUT_OF_MEMORY;
    }
    json_object_set_new(root, "load_view",
                        json_pack("{sI sI sI sI sf}", "this_instance",
                                  (json_int_t)s->load_view.this_instance, "cluster",
                                  (json_int_t)s->load_view.cluster, "cluster_with_stale",
                                  (json_int_t)s->load_view.cluster_with_stale, "engine_reported",
                                  (json_int_t)s->load_view.engine_reported, "oldest_age_ms_max",
                                  s->load_view.oldest_age_ms_max));
    char *textual = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (!textual)
        return KM_ERR_OUT_OF_MEMORY;
    km_text_append_cstr(out, textual);
    km_text_append_cstr(out, "\n");
    free(textual);
    return out->status;
}
