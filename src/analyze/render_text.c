/* SPDX-License-Identifier: Apache-2.0 */
/* The text report of a finished analysis (km_analysis_render_text; docs/ANALYZE.md). */
#include "analyze/analyze_internal.h"

#include <inttypes.h>
#include <stdint.h>

static double percent(uint64_t part, uint64_t whole)
{
    return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

/* One line of the TTFT prediction: observed over predicted at p10 / p50 / p90, and each p50. */
static void text_ttft_ratio(km_text *out, const char *what, const km_analysis_ttft_ratio *r)
{
    if (!r->n) {
        km_text_printf(out, "  %s: none compared\n", what);
        return;
    }
    km_text_printf(out,
                   "  %s (%" PRIu64 "): observed / predicted p10 %#.3g, p50 %#.3g, p90 %#.3g; "
                   "observed p50 %.3f ms, predicted p50 %.3f ms\n",
                   what, r->n, r->ratio_p10, r->ratio_p50, r->ratio_p90, r->observed_p50_ms,
                   r->predicted_p50_ms);
}

/* A string from the records (or a file name) as the report shows it: every control character
 * and U+FFFE / U+FFFF by its substitute (km_analysis_substitute), never raw into a terminal. */
static void text_name(km_text *out, const char *s)
{
    km_analysis_append_shown(out, s);
}

/* "HOST POOL/WORKER", or "POOL/WORKER" without a host. */
static void text_worker(km_text *out, const char *host, const char *pool, const char *worker)
{
    text_name(out, host);
    if (*host)
        km_text_append_cstr(out, " ");
    text_name(out, pool);
    km_text_append_cstr(out, "/");
    text_name(out, worker);
}

/* label (a policy's name, from the records) padded to 16 bytes, then q. */
static void text_quality(km_text *out, const char *label, const km_analysis_quality *q)
{
    km_text_append_cstr(out, "  ");
    size_t before = out->length;
    text_name(out, label);
    for (size_t shown = out->length - before; shown < 16; shown++)
        km_text_append_cstr(out, " ");
    km_text_printf(out,
                   " decisions %" PRIu64 ", owner not chosen %" PRIu64 " (%.1f%%), stale %" PRIu64
                   ", known reuse %" PRIu64 " (router overrides %" PRIu64 "; %" PRIu64
                   " more without a prediction, not compared): predicted %" PRIu64
                   " / actual %" PRIu64 " tokens, exact %" PRIu64 " (%.1f%%), hit rate %.1f%%\n",
                   q->decisions, q->owner_not_chosen, percent(q->owner_not_chosen, q->decisions),
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
    for (size_t i = 0; i < n; i++) {
        km_text_append_cstr(out, "  ");
        text_name(out, items[i].file);
        km_text_printf(out, ":%" PRIu64 ": ", items[i].line);
        text_name(out, items[i].what);
        km_text_append_cstr(out, "\n");
    }
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
    if (in->warm_ups)
        km_text_printf(out, "note: %" PRIu64 " of the decisions are warm-ups (prefills no user "
                            "waited for): they and their outcomes are in no figure below\n",
                       in->warm_ups);
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

    const km_analysis_load_view *lv = &s->load_view;
    km_text_printf(out,
                   "\nload view (decision.load.scope)\n"
                   "  this_instance %" PRIu64 ", cluster %" PRIu64 " (with a stale instance %" PRIu64
                   "); engine_reported joined %" PRIu64 "; oldest contribution at most %.1f ms "
                   "old\n",
                   lv->this_instance, lv->cluster, lv->cluster_with_stale, lv->engine_reported,
                   lv->oldest_age_ms_max);

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

    const km_analysis_ttft_prediction *tp = &s->ttft_prediction;
    km_text_printf(out,
                   "\nTTFT prediction (decision.predicted_ttft_ms, the engine model's, against the "
                   "TTFT the outcome reports)\n"
                   "  decisions with a prediction %" PRIu64 ", compared %" PRIu64
                   " (router's clock %" PRIu64 ", kvmatch's %" PRIu64 ")\n",
                   tp->decisions_predicted, tp->all.n, tp->router_clock, tp->kvmatch_clock);
    text_ttft_ratio(out, "all", &tp->all);
    text_ttft_ratio(out, "no prefill waiting on the chosen worker", &tp->idle);
    text_ttft_ratio(out, "prefill waiting on the chosen worker", &tp->queued);

    km_text_printf(out, "\nrecovery windows (a worker's index state not LIVE): %zu\n", s->n_windows);
    for (size_t i = 0; i < s->n_windows; i++) {
        const km_analysis_window *w = &s->windows[i];
        km_text_append_cstr(out, "  ");
        text_worker(out, w->host, w->pool, w->worker);
        km_text_append_cstr(out, " (instance ");
        text_name(out, w->instance);
        km_text_append_cstr(out, "): ");
        text_name(out, w->state);
        km_text_printf(out,
                       " from +%.3f s to +%.3f s (%.3f s%s), %" PRIu64
                       " decisions of that instance and pool, hit rate %.1f%%, owner not chosen %"
                       PRIu64 "\n",
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

    km_text_printf(out, "\ndecision reasons (decision.reason; the owner not chosen, and of those "
                        "not weighed: its row eligible with a null cost while the chosen worker's "
                        "has one, as when ttft's load bound passes a holder over; the reuse the "
                        "owners held beyond the chosen workers)\n");
    for (size_t i = 0; i < s->n_reasons; i++) {
        const km_analysis_reason *why = &s->reasons[i];
        km_text_append_cstr(out, "  ");
        size_t before = out->length;
        text_name(out, why->policy);
        km_text_append_cstr(out, " ");
        if (*why->reason)
            text_name(out, why->reason);
        else
            km_text_append_cstr(out, "(null)");
        for (size_t shown = out->length - before; shown < 28; shown++)
            km_text_append_cstr(out, " ");
        km_text_printf(out,
                       " decisions %" PRIu64 ", owner not chosen %" PRIu64 " (not weighed %" PRIu64
                       "), reuse given up %" PRIu64 " tokens\n",
                       why->decisions, why->owner_not_chosen, why->owner_not_weighed,
                       why->given_up_tokens);
    }

    km_text_printf(out, "\nper worker (decisions that chose it, its in_flight at those decisions; "
                        "attempts a router override sent to it; decisions it was an ineligible "
                        "candidate in, and of them those it owned the prediction in)\n");
    for (size_t i = 0; i < s->n_workers; i++) {
        const km_analysis_worker *w = &s->workers[i];
        km_text_append_cstr(out, "  ");
        text_worker(out, w->host, w->pool, w->worker);
        km_text_printf(out, ": chosen %" PRIu64 " (%.1f%%), in_flight mean %.2f max %" PRIu64,
                       w->chosen,
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
