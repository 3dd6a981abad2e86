/* SPDX-License-Identifier: Apache-2.0 */
/* Reports of a load sweep (src/sim/report.h): the text table and the HTML page with its charts. */
#include "sim/report.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"
#include "kvmatch/metrics.h"
#include "base/error_detail.h"

static uint32_t n_loads(const km_sim_report *r)
{
    return r->cfg->n_loads ? r->cfg->n_loads : 1;
}

/* Whether the summary holds each load's floor (km_sim_summary.floor_ttft_p50_ms): a sweep's. */
static bool has_floor(const km_sim_report *r)
{
    return r->cfg->n_loads && r->summary && r->summary->floor_ttft_p50_ms[0] > 0;
}

static const km_sim_result *at(const km_sim_report *r, uint32_t load, uint32_t policy)
{
    return &r->results[load * r->cfg->n_policies + policy];
}

/* The default policy's column, or -1 when it did not run. */
static int default_column(const km_sim_report *r)
{
    for (uint32_t p = 0; r->default_policy && p < r->cfg->n_policies; p++)
        if (!strcmp(r->cfg->policies[p], r->default_policy))
            return (int)p;
    return -1;
}

/* other / default, or 0 when the default's figure is 0; NAN when either has no sample. */
static double ratio(double other, double dflt)
{
    if (isnan(other) || isnan(dflt))
        return NAN;
    return dflt > 0 ? other / dflt : 0;
}

/* A TTFT figure (ms) or a ratio in width columns: "-" when it has no sample (NAN). */
static void print_figure(FILE *out, int width, int digits, double v)
{
    if (isnan(v))
        fprintf(out, " %*s", width, "-");
    else
        fprintf(out, " %*.*f", width, digits, v);
}

/* The same into buf. */
static void format_figure(char *buf, size_t size, int digits, double v)
{
    if (isnan(v))
        snprintf(buf, size, "-");
    else
        snprintf(buf, size, "%.*f", digits, v);
}

void km_sim_load_label(double load, char *buf, size_t size)
{
    snprintf(buf, size, "%.2f", load);
    if (strtod(buf, NULL) == load)
        return;
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(buf, size, "%.*g", digits, load);
        if (strtod(buf, NULL) == load)
            return;
    }
}

/* Which requests the TTFT figures count, "" when all: for both reports. */
static void ttft_scope(const km_sim_report *r, char *buf, size_t size)
{
    buf[0] = '\0';
    if (r->cfg->ttft_from)
        snprintf(buf, size, "TTFT over requests %zu-%llu (the first %zu warm the engines)",
                 r->cfg->ttft_from, (unsigned long long)r->summary->workload.requests - 1,
                 r->cfg->ttft_from);
}

void km_sim_report_text(const km_sim_report *r, FILE *out)
{
    const km_sim_config *cfg = r->cfg;
    fprintf(out, "workload %s, %llu requests, %u workers, engine %s", r->workload,
            (unsigned long long)r->summary->workload.requests, cfg->workers, r->engine);
    if (cfg->policy_engine)
        fprintf(out, " (the policies assume %s)", cfg->policy_engine);
    fprintf(out, "; capacity %.2f requests/s\n", r->summary->capacity_rps);
    char scope[128];
    ttft_scope(r, scope, sizeof scope);
    if (scope[0])
        fprintf(out, "%s\n", scope);
    fprintf(out, "%-24s", "");
    for (uint32_t p = 0; p < cfg->n_policies; p++)
        fprintf(out, " %12s", cfg->policies[p]);
    fprintf(out, "\n");
    static const char *const metrics[] = {"ttft_p50_ms", "ttft_p99_ms", "reused_share"};
    for (uint32_t l = 0; l < n_loads(r); l++)
        for (int k = 0; k < 3; k++) {
            char label[64], load[32];
            km_sim_load_label(cfg->loads[l], load, sizeof load);
            snprintf(label, sizeof label, "load %s %s", load, metrics[k]);
            fprintf(out, "%-24s", label);
            for (uint32_t p = 0; p < cfg->n_policies; p++) {
                const km_sim_result *x = at(r, l, p);
                if (k == 0)
                    print_figure(out, 12, 1, x->ttft_p50_ms);
                else if (k == 1)
                    print_figure(out, 12, 1, x->ttft_p99_ms);
                else
                    fprintf(out, " %11.1f%%", 100.0 * x->reused_share);
            }
            fprintf(out, "\n");
        }
    if (has_floor(r)) {
        fprintf(out, "floor, the TTFT no routing goes below, p50 / p99 ms:");
        for (uint32_t l = 0; l < n_loads(r); l++) {
            char load[32], p50[16], p99[16];
            km_sim_load_label(cfg->loads[l], load, sizeof load);
            format_figure(p50, sizeof p50, 1, r->summary->floor_ttft_p50_ms[l]);
            format_figure(p99, sizeof p99, 1, r->summary->floor_ttft_p99_ms[l]);
            fprintf(out, "%s load %s %s / %s", l ? "," : "", load, p50, p99);
        }
        fprintf(out, "\n");
    }
    int d = default_column(r);
    if (d < 0 || cfg->n_policies < 2)
        return;
    fprintf(out, "\n%s (default) against each policy: its TTFT over the default's, p50 / p99 "
                 "(above 1: the default is faster)\n%-14s",
            r->default_policy, "");
    for (uint32_t l = 0; l < n_loads(r); l++) {
        char label[48], load[32];
        km_sim_load_label(cfg->loads[l], load, sizeof load);
        snprintf(label, sizeof label, "load %s", load);
        fprintf(out, " %15s", label);
    }
    fprintf(out, "\n");
    for (uint32_t p = 0; p < cfg->n_policies; p++) {
        if ((int)p == d)
            continue;
        fprintf(out, "%-14s", cfg->policies[p]);
        for (uint32_t l = 0; l < n_loads(r); l++) {
            const km_sim_result *x = at(r, l, p), *y = at(r, l, (uint32_t)d);
            char cell[48], p50[16], p99[16];
            format_figure(p50, sizeof p50, 2, ratio(x->ttft_p50_ms, y->ttft_p50_ms));
            format_figure(p99, sizeof p99, 2, ratio(x->ttft_p99_ms, y->ttft_p99_ms));
            snprintf(cell, sizeof cell, "%s / %s", p50, p99);
            fprintf(out, " %15s", cell);
        }
        fprintf(out, "\n");
    }
}

/* ---- HTML ------------------------------------------------------------------------------------ */

#define CHART_W 640
#define CHART_H 360
#define LEFT 72
#define RIGHT 150
#define TOP 36
#define BOTTOM 52

static const char *const palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

/* A round step for about `want` intervals over range: 1, 2, 2.5 or 5 times a power of ten. */
static double nice_step(double range, int want)
{
    if (!(range > 0))
        return 1;
    double raw = range / want, mag = pow(10, floor(log10(raw))), f = raw / mag;
    double nice = f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10;
    return nice * mag;
}

typedef struct axis {
    double lo, hi;
    int log; /* log10 scale */
} axis;

static double x_px(const axis *a, double v)
{
    return LEFT + (v - a->lo) / (a->hi - a->lo) * (CHART_W - LEFT - RIGHT);
}

static double y_px(const axis *a, double v)
{
    double t = a->log ? (log10(v) - log10(a->lo)) / (log10(a->hi) - log10(a->lo))
                      : (v - a->lo) / (a->hi - a->lo);
    return CHART_H - BOTTOM - t * (CHART_H - TOP - BOTTOM);
}

static void tick_label(char *buf, size_t size, double v)
{
    if (v >= 1000 && fmod(v, 1000) == 0)
        snprintf(buf, size, "%gk", v / 1000);
    else
        snprintf(buf, size, "%g", v);
}

/* A horizontal grid line at value v, labelled on the y axis. */
static void y_gridline(km_text *t, const axis *y, double v)
{
    char label[32];
    double py = y_px(y, v);
    tick_label(label, sizeof label, v);
    km_text_printf(t,
                   "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                   "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                   LEFT, py, CHART_W - RIGHT, py, LEFT - 6, py + 4, label);
}

/* metric: 0 TTFT p50, 1 TTFT p99 (ms, log scale), 2 reused share (%, linear). */
static double metric(const km_sim_result *x, int which)
{
    return which == 0 ? x->ttft_p50_ms : which == 1 ? x->ttft_p99_ms : 100.0 * x->reused_share;
}

/* The floor's TTFT p50 (which 0) or p99 (1) at load l. */
static double floor_metric(const km_sim_report *r, uint32_t l, int which)
{
    return which == 0 ? r->summary->floor_ttft_p50_ms[l] : r->summary->floor_ttft_p99_ms[l];
}

static void chart(const km_sim_report *r, km_text *t, int which)
{
    static const char *const ids[] = {"chart-ttft-p50", "chart-ttft-p99", "chart-reuse"};
    static const char *const titles[] = {"TTFT p50 against load (ms, log scale)",
                                         "TTFT p99 against load (ms, log scale)",
                                         "Prompt tokens reused against load (%)"};
    const km_sim_config *cfg = r->cfg;
    uint32_t nl = n_loads(r);
    axis x = {cfg->loads[0], cfg->loads[0], 0};
    double lo = INFINITY, hi = 0;
    for (uint32_t l = 0; l < nl; l++) {
        if (cfg->loads[l] < x.lo)
            x.lo = cfg->loads[l];
        if (cfg->loads[l] > x.hi)
            x.hi = cfg->loads[l];
        for (uint32_t p = 0; p < cfg->n_policies; p++) {
            double v = metric(at(r, l, p), which);
            if (which < 2 && !(v > 0))
                continue;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        if (which < 2 && has_floor(r)) {
            double v = floor_metric(r, l, which);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
    }
    double xstep = nice_step(x.hi - x.lo, 5);
    x.lo = floor(x.lo / xstep) * xstep;
    x.hi = ceil(x.hi / xstep) * xstep;
    if (x.hi <= x.lo)
        x.hi = x.lo + xstep;
    axis y;
    if (which < 2) {
        if (!isfinite(lo))
            lo = hi = 1;
        y.lo = pow(10, floor(log10(lo)));
        y.hi = pow(10, ceil(log10(hi)));
        if (y.hi <= y.lo)
            y.hi = y.lo * 10;
        y.log = 1;
    } else {
        double ystep = nice_step(hi > 0 ? hi : 1, 5);
        y.lo = 0;
        y.hi = ceil((hi > 0 ? hi : 1) / ystep) * ystep;
        y.log = 0;
    }
    km_text_printf(t,
                   "<h2>%s</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"%s\" width=\"%d\" "
                   "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
                   titles[which], ids[which], CHART_W, CHART_H, CHART_W, CHART_H);
    /* axes and ticks */
    km_text_printf(t, "<g stroke=\"#444\">\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/>\n",
                   LEFT, CHART_H - BOTTOM, CHART_W - RIGHT, CHART_H - BOTTOM);
    km_text_printf(t, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/>\n</g>\n", LEFT, TOP, LEFT,
                   CHART_H - BOTTOM);
    char label[32];
    /* Each tick counted from the axis's start (no error accumulates), labelled with %g's six
     * significant digits: distinct ticks read apart however small the step. */
    for (int i = 0; x.lo + i * xstep <= x.hi + xstep / 2; i++) {
        double v = x.lo + i * xstep;
        double px = x_px(&x, v);
        tick_label(label, sizeof label, v);
        km_text_printf(t,
                       "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#444\"/>"
                       "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n",
                       px, CHART_H - BOTTOM, px, CHART_H - BOTTOM + 5, px, CHART_H - BOTTOM + 19,
                       label);
    }
    if (y.log) {
        for (double dec = y.lo; dec < y.hi * 1.0001; dec *= 10)
            for (int m = 1; m <= 5; m += m == 1 ? 1 : 3) { /* 1, 2, 5 */
                double v = dec * m;
                if (v > y.hi * 1.0001)
                    break;
                y_gridline(t, &y, v);
            }
    } else {
        double ystep = nice_step(y.hi, 5);
        for (double v = 0; v <= y.hi + ystep / 2; v += ystep) {
            y_gridline(t, &y, v);
        }
    }
    km_text_printf(t, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">offered load (fraction of "
                      "capacity)</text>\n",
                   (LEFT + CHART_W - RIGHT) / 2, CHART_H - 12);
    km_text_printf(t,
                   "<text x=\"16\" y=\"%d\" transform=\"rotate(-90 16 %d)\" "
                   "text-anchor=\"middle\">%s</text>\n",
                   (TOP + CHART_H - BOTTOM) / 2, (TOP + CHART_H - BOTTOM) / 2,
                   which < 2 ? "TTFT (ms)" : "reused (%)");
    /* one line per policy, the default drawn wider */
    int d = default_column(r);
    for (uint32_t p = 0; p < cfg->n_policies; p++) {
        const char *color = palette[p % (sizeof palette / sizeof palette[0])];
        km_text_printf(t, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" points=\"",
                       color, (int)p == d ? "3.5" : "1.5");
        for (uint32_t l = 0; l < nl; l++) {
            double v = metric(at(r, l, p), which);
            if (y.log && !(v > 0))
                continue;
            km_text_printf(t, "%.1f,%.1f ", x_px(&x, cfg->loads[l]), y_px(&y, v));
        }
        km_text_printf(t, "\"/>\n");
        for (uint32_t l = 0; l < nl; l++) {
            double v = metric(at(r, l, p), which);
            if (y.log && !(v > 0))
                continue;
            km_text_printf(t, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                           x_px(&x, cfg->loads[l]), y_px(&y, v), color);
        }
        double ly = TOP + 16.0 * p;
        km_text_printf(t,
                       "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
                       "stroke-width=\"%s\"/><text x=\"%d\" y=\"%.1f\">%s%s</text>\n",
                       CHART_W - RIGHT + 12, ly, CHART_W - RIGHT + 32, ly, color,
                       (int)p == d ? "3.5" : "1.5", CHART_W - RIGHT + 38, ly + 4, cfg->policies[p],
                       (int)p == d ? " (default)" : "");
    }
    /* the floor no routing goes below, dashed */
    if (which < 2 && has_floor(r)) {
        km_text_printf(t, "<polyline class=\"floor\" fill=\"none\" stroke=\"#000\" "
                          "stroke-width=\"1.5\" stroke-dasharray=\"6 4\" points=\"");
        for (uint32_t l = 0; l < nl; l++)
            km_text_printf(t, "%.1f,%.1f ", x_px(&x, cfg->loads[l]),
                           y_px(&y, floor_metric(r, l, which)));
        double ly = TOP + 16.0 * cfg->n_policies;
        km_text_printf(t,
                       "\"/>\n<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#000\" "
                       "stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/><text x=\"%d\" y=\"%.1f\">"
                       "floor</text>\n",
                       CHART_W - RIGHT + 12, ly, CHART_W - RIGHT + 32, ly, CHART_W - RIGHT + 38,
                       ly + 4);
    }
    km_text_printf(t, "</svg>\n");
}

static void html_escape(km_text *t, const char *s)
{
    for (; s && *s; s++) {
        if (*s == '<')
            km_text_append_cstr(t, "&lt;");
        else if (*s == '>')
            km_text_append_cstr(t, "&gt;");
        else if (*s == '&')
            km_text_append_cstr(t, "&amp;");
        else if (*s == '"')
            km_text_append_cstr(t, "&quot;");
        else
            km_text_append(t, s, 1);
    }
}

int km_sim_report_html(const km_sim_report *r, const char *path, char *why, size_t why_size)
{
    km_text t;
    km_text_init(&t, 64u << 20);
    const km_sim_config *cfg = r->cfg;
    const km_sim_workload_stats *w = &r->summary->workload;
    km_text_printf(&t, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvmatch sim: "
                       "routing policies against load</title>\n<style>body{font-family:sans-serif;"
                       "margin:24px;max-width:900px}table{border-collapse:collapse;font-size:13px}"
                       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
                       "th:first-child,td:first-child{text-align:left}svg{display:block;"
                       "margin:8px 0;border:1px solid #ddd}</style></head><body>\n");
    km_text_printf(&t, "<h1>Routing policies against load</h1>\n<p>Workload <b>");
    html_escape(&t, r->workload);
    km_text_printf(&t,
                   "</b>: %llu requests, prompts of %.0f tokens on average (p50 %.0f, p99 %.0f), "
                   "%.1f%% of prompt tokens reusable in principle. %u workers, engine <b>",
                   (unsigned long long)w->requests, w->prompt_mean, w->prompt_p50, w->prompt_p99,
                   100.0 * w->reusable_share, cfg->workers);
    html_escape(&t, r->engine);
    km_text_printf(&t, "</b>");
    if (cfg->policy_engine) {
        km_text_printf(&t, " (the policies assume <b>");
        html_escape(&t, cfg->policy_engine);
        km_text_printf(&t, "</b>)");
    }
    km_text_printf(&t,
                   ". Capacity (round robin, every request at once): %.2f requests/s; a load "
                   "of 1 offers that rate. Default policy: <b>",
                   r->summary->capacity_rps);
    html_escape(&t, r->default_policy ? r->default_policy : "");
    km_text_printf(&t, "</b>.");
    char scope[128];
    ttft_scope(r, scope, sizeof scope);
    if (scope[0])
        km_text_printf(&t, " %s.", scope);
    if (has_floor(r))
        km_text_printf(&t, " Dashed: the floor, the TTFT no routing goes below at that load.");
    km_text_printf(&t, "</p>\n");
    for (int which = 0; which < 3; which++)
        chart(r, &t, which);
    km_text_printf(&t, "<h2>Figures</h2>\n<table><tr><th>load</th><th>policy</th><th>TTFT p50 "
                       "ms</th><th>TTFT p99 ms</th><th>TTFT mean ms</th><th>reused</th>"
                       "<th>throughput req/s</th></tr>\n");
    for (uint32_t l = 0; l < n_loads(r); l++)
        for (uint32_t p = 0; p < cfg->n_policies; p++) {
            const km_sim_result *x = at(r, l, p);
            char load[32];
            km_sim_load_label(cfg->loads[l], load, sizeof load);
            km_text_printf(&t, "<tr><td>%s</td><td>", load);
            html_escape(&t, cfg->policies[p]);
            char p50[32], p99[32], mean[32];
            format_figure(p50, sizeof p50, 1, x->ttft_p50_ms);
            format_figure(p99, sizeof p99, 1, x->ttft_p99_ms);
            format_figure(mean, sizeof mean, 1, x->ttft_mean_ms);
            km_text_printf(&t,
                           "</td><td>%s</td><td>%s</td><td>%s</td><td>%.1f%%</td>"
                           "<td>%.2f</td></tr>\n",
                           p50, p99, mean, 100.0 * x->reused_share, x->throughput_rps);
        }
    km_text_printf(&t, "</table>\n</body></html>\n");
    int rc = t.status;
    if (rc)
        km_why(why, why_size, rc, "the report does not fit in memory");
    FILE *f = rc ? NULL : fopen(path, "w");
    if (!rc && !f)
        rc = km_why(why, why_size, KM_ERR_IO, "cannot write %s", path);
    if (f) {
        int bad = fwrite(km_text_cstr(&t), 1, t.length, f) != t.length;
        if (fclose(f) != 0 || bad)
            rc = km_why(why, why_size, KM_ERR_IO, "writing %s failed", path);
    }
    km_text_free(&t);
    return rc;
}
