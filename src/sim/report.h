/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: the reports of a `kvmatch sim` load sweep (docs/SIM.md, "Load sweeps"): a text table
 * of every policy at every load, the default policy against each other policy, and a
 * self-contained HTML page with SVG charts of TTFT p50, TTFT p99 and reuse against load. */
#ifndef KM_SIM_REPORT_H
#define KM_SIM_REPORT_H

#include <stdio.h>

#include "sim/sim.h"

/* What a report shows: cfg's loads and policies, results in km_sim_run's load-major order. */
typedef struct km_sim_report {
    const km_sim_config *cfg;
    const km_sim_result *results;
    const km_sim_summary *summary;
    const char *workload;       /* "chat", ..., or the trace's path */
    const char *engine;         /* the engine preset's name, or "custom" */
    const char *default_policy; /* the policy a pool runs when none is named */
} km_sim_report;

/* A load as the reports label it: two decimals when that is the load exactly ("0.80"), else the
 * shortest form that reads back as the load ("0.001"), so distinct loads keep distinct labels. */
void km_sim_load_label(double load, char *buf, size_t size);

/* The sweep table: per load, TTFT p50 / p99 (ms) and the share of prompt tokens reused, one
 * column per policy; a line of each load's floor (summary->floor_ttft_p50_ms / p99, when the
 * summary has them); then, when default_policy ran, its TTFT p50 / p99 against each other
 * policy's at every load (the other's over the default's: above 1 the default is faster). The
 * HTML page draws the floor dashed on the TTFT charts. */
void km_sim_report_text(const km_sim_report *report, FILE *out);

/* The HTML page (no script, no external resource) at path. Errors: KM_ERR_IO (why says which
 * path), KM_ERR_OUT_OF_MEMORY. */
int km_sim_report_html(const km_sim_report *report, const char *path, char *why, size_t why_size);

#endif
