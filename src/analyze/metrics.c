/* SPDX-License-Identifier: Apache-2.0 */
/* The metrics of a finished analysis (src/analyze/analyze.h, docs/ANALYZE.md): once the last
 * file is read, km_analysis_finish completes the join and derives every figure of the summary in
 * passes over the points: reuse predicted against actual, owner against chosen, staleness,
 * outcome kinds and TTFT percentiles, per policy and per worker, and the recovery windows (swept
 * from the index-state observations) with the routing quality inside and outside them. */
#include "analyze/analyze_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/records.h"

/* ---- orders of points, observations, windows, policies and workers --------------------------- */

/* The analysis whose points the comparators below read (qsort has no context argument);
 * thread-local, so handles finished on different threads stay independent. */
static _Thread_local const km_analysis *sort_context;

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

static int compare_reasons(const void *x, const void *y)
{
    const km_analysis_reason *p = x, *q = y;
    int c = strcmp(p->policy, q->policy);
    return c ? c : strcmp(p->reason, q->reason);
}

/* Decisions by (policy, reason): a->reasons, sorted. A map from the pair's string ids to its row
 * keeps this linear in the decisions, however many distinct reasons the records name. */
static int build_reasons(km_analysis *a, size_t *n_out)
{
    km_u64map rows;
    km_u64map_init(&rows, &a->memory);
    size_t n = 0, capacity = 0;
    int rc = KM_OK;
    for (size_t i = 0; i < a->n_points && rc == KM_OK; i++) {
        const point *p = &a->points[i];
        if (!POINT_COUNTED(p) || !(p->flags & POINT_DECISION))
            continue;
        uint64_t key = km_u64map_key((uint64_t)p->policy << 32 | p->reason);
        uint64_t *at = km_u64map_find(&rows, key);
        km_analysis_reason *row;
        if (at) {
            row = &a->reasons[*at];
        } else {
            if (n == capacity) {
                size_t grown = capacity ? 2 * capacity : 16;
                km_analysis_reason *more = realloc(a->reasons, grown * sizeof *more);
                if (!more) {
                    rc = km_analysis_fail_memory(a, "counting decision reasons");
                    break;
                }
                a->reasons = more;
                capacity = grown;
            }
            rc = km_u64map_put(&rows, key, n, 1);
            if (rc != KM_OK) {
                rc = km_analysis_fail_memory(a, "counting decision reasons");
                break;
            }
            row = &a->reasons[n++];
            *row = (km_analysis_reason){.policy = str(a, p->policy), .reason = str(a, p->reason)};
        }
        row->decisions++;
        if (p->flags & POINT_OWNER_NOT_CHOSEN) {
            row->owner_not_chosen++;
            row->owner_not_weighed += (p->flags & POINT_OWNER_NOT_WEIGHED) != 0;
            if (p->owner_tokens > p->predicted)
                add_tokens(&row->given_up_tokens, (uint64_t)(p->owner_tokens - p->predicted));
        }
    }
    km_u64map_free(&rows);
    sort_items(a->reasons, n, sizeof *a->reasons, compare_reasons);
    *n_out = n;
    return rc;
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

/* ---- per-worker rows, quality, recovery windows ---------------------------------------------- */

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
    add_tokens(&q->predicted_tokens, (uint64_t)predicted);
    add_tokens(&q->actual_tokens, (uint64_t)p->actual);
    if (p->actual == predicted)
        q->exact++;
    int64_t prompt = p->outcome_prompt >= 0 ? p->outcome_prompt : p->decision_prompt;
    if (prompt >= 0) {
        add_tokens(&q->prompt_tokens, (uint64_t)prompt);
        add_tokens(&q->actual_with_prompt, (uint64_t)p->actual);
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
        if (POINT_COUNTED(&a->points[i]) && (a->points[i].flags & POINT_DECISION))
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

/* ---- TTFT prediction ------------------------------------------------------------------------- */

/* One compared outcome: its observed and predicted times, and observed / predicted. */
typedef struct ttft_pair {
    double observed_ms, predicted_ms, ratio;
    bool queued; /* prefill was waiting on the chosen worker */
} ttft_pair;

static int compare_ratio(const void *x, const void *y)
{
    return compare_double(&((const ttft_pair *)x)->ratio, &((const ttft_pair *)y)->ratio);
}

/* The nearest-rank q-th percentile of one field of pairs[0..n), n > 0, after sorting by it. */
static double pair_percentile(ttft_pair *pairs, size_t n, size_t offset, unsigned q)
{
    size_t rank = (n * q + 99) / 100;
    return *(const double *)((const char *)&pairs[rank ? rank - 1 : 0] + offset);
}

static int compare_observed(const void *x, const void *y)
{
    return compare_double(&((const ttft_pair *)x)->observed_ms,
                          &((const ttft_pair *)y)->observed_ms);
}

static int compare_predicted(const void *x, const void *y)
{
    return compare_double(&((const ttft_pair *)x)->predicted_ms,
                          &((const ttft_pair *)y)->predicted_ms);
}

static void ttft_ratio_of(ttft_pair *pairs, size_t n, km_analysis_ttft_ratio *out)
{
    *out = (km_analysis_ttft_ratio){.n = n};
    if (!n)
        return;
    sort_items(pairs, n, sizeof *pairs, compare_observed);
    out->observed_p50_ms = pair_percentile(pairs, n, offsetof(ttft_pair, observed_ms), 50);
    sort_items(pairs, n, sizeof *pairs, compare_predicted);
    out->predicted_p50_ms = pair_percentile(pairs, n, offsetof(ttft_pair, predicted_ms), 50);
    sort_items(pairs, n, sizeof *pairs, compare_ratio);
    out->ratio_p10 = pair_percentile(pairs, n, offsetof(ttft_pair, ratio), 10);
    out->ratio_p50 = pair_percentile(pairs, n, offsetof(ttft_pair, ratio), 50);
    out->ratio_p90 = pair_percentile(pairs, n, offsetof(ttft_pair, ratio), 90);
}

/* km_analysis_ttft_prediction over the counted points (its contract is in analyze.h). */
static int ttft_prediction(km_analysis *a)
{
    km_analysis_ttft_prediction *tp = &a->summary.ttft_prediction;
    ttft_pair *pairs = malloc((a->n_points + 1) * sizeof *pairs);
    if (!pairs)
        return km_analysis_fail_memory(a, "comparing predicted times to first token");
    size_t n = 0;
    for (size_t i = 0; i < a->n_points; i++) {
        const point *p = &a->points[i];
        uint32_t f = p->flags;
        if (!POINT_COUNTED(p) || !(f & POINT_DECISION) || p->predicted_ttft_ms < 0)
            continue;
        tp->decisions_predicted++;
        if (!(f & POINT_OUTCOME) || (f & POINT_OVERRIDDEN) ||
            p->outcome_kind != KM_RECORD_OUTCOME_COMPLETE || !(p->predicted_ttft_ms > 0))
            continue;
        bool router = p->router_ttft_ms >= 0;
        if (!router && p->ttft_ns < 0)
            continue;
        double observed = router ? p->router_ttft_ms : (double)p->ttft_ns / 1e6;
        ttft_pair pair = {observed, p->predicted_ttft_ms, observed / p->predicted_ttft_ms,
                          (f & POINT_CHOSEN_QUEUED) != 0};
        if (!isfinite(pair.ratio))
            continue; /* a prediction too close to 0 for the ratio to be held */
        tp->router_clock += router;
        tp->kvmatch_clock += !router;
        pairs[n++] = pair;
    }
    ttft_ratio_of(pairs, n, &tp->all);
    /* The idle ones first, then the queued ones (each split's percentiles sort it anew). */
    size_t n_idle = 0;
    for (size_t i = 0; i < n; i++)
        if (!pairs[i].queued) {
            ttft_pair t = pairs[n_idle];
            pairs[n_idle++] = pairs[i];
            pairs[i] = t;
        }
    ttft_ratio_of(pairs, n_idle, &tp->idle);
    ttft_ratio_of(pairs + n_idle, n - n_idle, &tp->queued);
    free(pairs);
    return KM_OK;
}

/* ---- finish ---------------------------------------------------------------------------------- */

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
            if (POINT_COUNTED(p) && !seen[p->host]) {
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
        if ((f & POINT_WARM_UP) && !(f & POINT_MERGED_AWAY))
            s->input.warm_ups += (f & POINT_DECISION) != 0;
        if (!POINT_COUNTED(p))
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
                add_tokens(&r->predicted_tokens, (uint64_t)predicted);
                add_tokens(&r->actual_tokens, (uint64_t)p->actual);
                int64_t d = p->actual - predicted;
                if (d == 0)
                    r->exact++;
                else if (d < 0) {
                    r->over_predicted++;
                    add_tokens(&r->over_predicted_tokens, (uint64_t)-d);
                } else {
                    r->under_predicted++;
                    add_tokens(&r->under_predicted_tokens, (uint64_t)d);
                }
                r->difference_buckets[km_analysis_diff_bucket(d)]++;
                if ((double)predicted > max_tokens)
                    max_tokens = (double)predicted;
                if ((double)p->actual > max_tokens)
                    max_tokens = (double)p->actual;
            }
            km_analysis_outcomes *o = &s->outcomes;
            switch (p->outcome_kind) {
            case KM_RECORD_OUTCOME_COMPLETE: o->complete++; break;
            case KM_RECORD_OUTCOME_INCOMPLETE:
                o->incomplete++;
                if (f & POINT_HTTP_200)
                    o->incomplete_http_200++;
                break;
            case KM_RECORD_OUTCOME_ERROR: o->error++; break;
            case KM_RECORD_OUTCOME_CANCELLED: o->cancelled++; break;
            default: o->expired++; break;
            }
            bool complete = p->outcome_kind == KM_RECORD_OUTCOME_COMPLETE;
            if (complete && p->ttft_ns >= 0)
                ttfts[n_ttft++] = p->ttft_ns;
            if (complete && p->router_ttft_ms >= 0)
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
                /* the owner is at least as deep as the chosen worker (join.c refuses others) */
                uint64_t cost = (uint64_t)(p->owner_tokens - p->predicted);
                add_tokens(&ow->cost_tokens, cost);
                add_tokens(&ow->owner_tokens, (uint64_t)p->owner_tokens);
                add_tokens(&ow->chosen_tokens, (uint64_t)p->predicted);
                km_analysis_owner_part *part =
                    f & POINT_OWNER_INELIGIBLE ? &ow->owner_ineligible : &ow->owner_eligible;
                part->decisions++;
                add_tokens(&part->cost_tokens, cost);
                add_tokens(&part->owner_tokens, (uint64_t)p->owner_tokens);
                add_tokens(&part->chosen_tokens, (uint64_t)p->predicted);
                /* what the chosen worker really reused: an overridden attempt's cached tokens
                 * came from another worker's engine */
                if ((f & POINT_OUTCOME) && p->actual >= 0 && (f & POINT_OVERRIDDEN)) {
                    ow->joined_overridden++;
                    part->joined_overridden++;
                } else if ((f & POINT_OUTCOME) && p->actual >= 0) {
                    ow->joined_known++;
                    add_tokens(&ow->joined_actual_tokens, (uint64_t)p->actual);
                    add_tokens(&ow->joined_owner_tokens, (uint64_t)p->owner_tokens);
                    part->joined_known++;
                    add_tokens(&part->joined_actual_tokens, (uint64_t)p->actual);
                    add_tokens(&part->joined_owner_tokens, (uint64_t)p->owner_tokens);
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
    size_t n_reasons = 0;
    rc = build_reasons(a, &n_reasons);
    if (rc != KM_OK)
        return rc;

    rc = build_windows(a);
    if (rc != KM_OK)
        return rc;
    rc = ttft_prediction(a);
    if (rc != KM_OK)
        return rc;
    rc = assign_windows(a);
    if (rc != KM_OK)
        return rc;
    for (size_t i = 0; i < a->n_points; i++) {
        const point *p = &a->points[i];
        if (!POINT_COUNTED(p) || !(p->flags & POINT_DECISION))
            continue;
        quality_add(p->flags & POINT_IN_WINDOW ? &s->in_windows : &s->outside_windows, p);
    }
    quality_finish(&s->in_windows);
    quality_finish(&s->outside_windows);

    /* unjoined lists, in reading order: the points join counts (warm-ups are in no figure) */
    for (size_t i = 0; i < a->n_points && rc == KM_OK; i++) {
        const point *p = &a->points[i];
        if (!POINT_COUNTED(p))
            continue;
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

    /* decision points by time, for the charts (warm-ups are in none) */
    a->time_order = malloc((a->n_points + 1) * sizeof *a->time_order);
    if (!a->time_order)
        return km_analysis_fail_memory(a, "ordering decisions");
    for (size_t i = 0; i < a->n_points; i++)
        if (POINT_COUNTED(&a->points[i]) && (a->points[i].flags & POINT_DECISION))
            a->time_order[a->n_time_order++] = (uint32_t)i;
    sort_context = a;
    sort_items(a->time_order, a->n_time_order, sizeof *a->time_order, compare_by_time);

    s->windows = a->windows;
    s->n_windows = a->n_windows;
    s->policies = a->policies;
    s->n_policies = n_policies;
    s->reasons = a->reasons;
    s->n_reasons = n_reasons;
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

/* ---- difference buckets ---------------------------------------------------------------------- */

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
