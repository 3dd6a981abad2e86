/* SPDX-License-Identifier: Apache-2.0 */
/* The HTML report of a finished analysis (km_analysis_render_html, km_analysis_write_html;
 * docs/ANALYZE.md): one self-contained page, the summary table, inline SVG charts drawn from the
 * points (predicted against actual reuse, hit rate over time with the recovery windows shaded,
 * load per worker over time), the quality table and the text report, every string escaped. */
#include "analyze/analyze_internal.h"
#include "base/utf8.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Most workers drawn in the load chart (the most chosen ones), most points in the scatter, most
 * windows shaded. */
#define ANALYSIS_CHART_MAX_WORKERS 10
#define ANALYSIS_CHART_MAX_POINTS 2000
#define ANALYSIS_CHART_MAX_WINDOWS 500

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

/* Text with &, <, >, " and ' escaped and the characters XML cannot carry (and every other control
 * character) shown by their substitutes (km_analysis_substitute): safe in element content and in
 * quoted attributes, in HTML and in the SVG's XML alike. keep_lines keeps line feeds (the text
 * report's own lines, whose strings from the records are already shown that way). */
static void escape(km_text *out, const char *s, int keep_lines)
{
    const char *run = s;
    char substitute[8];
    while (*s) {
        const char *entity = NULL;
        size_t n = 1;
        switch (*s) {
        case '&': entity = "&amp;"; break;
        case '<': entity = "&lt;"; break;
        case '>': entity = "&gt;"; break;
        case '"': entity = "&quot;"; break;
        case '\'': entity = "&#39;"; break;
        case '\n':
            if (keep_lines)
                break;
            /* fall through */
        default:
            n = km_analysis_substitute(s, substitute);
            entity = n ? substitute : NULL;
            break;
        }
        if (entity) {
            km_text_append(out, run, (size_t)(s - run));
            km_text_append_cstr(out, entity);
            s += n;
            run = s;
        } else {
            s++;
        }
    }
    km_text_append(out, run, (size_t)(s - run));
}

static void html_escape(km_text *out, const char *s)
{
    escape(out, s, 0);
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
        if (!POINT_COUNTED(p) || !(p->flags & POINT_OUTCOME) || p->actual < 0 ||
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
        add_tokens(&prompt[b], (uint64_t)prompt_tokens);
        add_tokens(&actual[b], (uint64_t)p->actual);
        add_tokens(&predicted[b], (uint64_t)predicted_tokens);
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
                   "<tr><td>decisions / outcomes (warm-ups among the decisions, in no figure "
                   "below)</td><td>%" PRIu64 " / %" PRIu64 " (%" PRIu64 ")</td></tr>\n"
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
                   s->input.decisions, s->input.outcomes, s->input.warm_ups, s->join.by_decision_id,
                   s->join.by_request,
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
    const km_analysis_ttft_prediction *tp = &s->ttft_prediction;
    km_text_printf(out,
                   "<table id=\"ttft_prediction\"><tr><th>TTFT observed / predicted (the engine "
                   "model's)</th><th>compared</th><th>p10</th><th>p50</th><th>p90</th></tr>\n");
    const struct {
        const char *what;
        const km_analysis_ttft_ratio *r;
    } rows[] = {{"all", &tp->all},
                {"no prefill waiting on the chosen worker", &tp->idle},
                {"prefill waiting on the chosen worker", &tp->queued}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        km_text_printf(out,
                       "<tr><td>%s</td><td>%" PRIu64 "</td><td>%#.3g</td><td>%#.3g</td><td>%#.3g</td>"
                       "</tr>\n",
                       rows[i].what, rows[i].r->n, rows[i].r->ratio_p10, rows[i].r->ratio_p50,
                       rows[i].r->ratio_p90);
    km_text_append_cstr(out, "</table>\n");
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
        /* A long name is cut to fit, between characters (the text report has it whole). */
        char label[160];
        const char *policy = s->policies[i].policy;
        int fits = (int)km_utf8_prefix(policy, sizeof label - sizeof "policy ");
        snprintf(label, sizeof label, "policy %.*s", fits, policy);
        html_quality_row(out, label, &s->policies[i].quality);
    }
    km_text_append_cstr(out, "</table>\n<h2>Full report</h2>\n<pre>");
    km_text report;
    km_text_init(&report, 0);
    rc = km_analysis_render_text(a, &report);
    if (rc == KM_OK)
        escape(out, km_text_cstr(&report), 1);
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
