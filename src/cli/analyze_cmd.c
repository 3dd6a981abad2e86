/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch analyze [--json] [--html OUT.html] RECORDS.jsonl...`: join decision and outcome records
 * and report how well routing predicted KV reuse (src/analyze/analyze.h, docs/ANALYZE.md). Exit status: 0
 * when the report was written (bad lines are reported, not fatal), 1 when no file could be read,
 * the input held no valid record (the report is still printed) or the report could not be written,
 * 2 on a usage error. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "analyze/analyze.h"
#include "cli/commands.h"
#include "cli/options.h"

static void analyze_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch analyze [--json] [--html OUT.html] RECORDS.jsonl...\n"
            "  Joins decision and outcome records (docs/RECORDS.md) and prints predicted vs actual\n"
            "  KV reuse, owner != chosen and its cost, stale or degraded predictions, outcomes and\n"
            "  recovery windows. Pass every file of a run, rotated ones included (PATH.N ... PATH).\n"
            "  --json       one JSON object instead of the text report (docs/ANALYZE.md)\n"
            "  --html OUT   also write a self-contained HTML report with SVG charts to OUT\n");
}

int km_cmd_analyze(int argc, char **argv)
{
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, 'j'},
        {"html", required_argument, NULL, 'H'},
        {NULL, 0, NULL, 0},
    };
    int json = 0;
    const char *html = NULL;
    /* options may come anywhere before "--" (getopt_long moves the files after them, in order) */
    km_cli_getopt_begin(argv, "analyze");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            analyze_usage(stdout);
            return KM_EXIT_OK;
        case 'j':
            json = 1;
            break;
        case 'H':
            html = optarg;
            break;
        default:
            return km_cli_usage_error("analyze");
        }
    }
    int n_files = argc - optind;
    argv += optind - 1; /* the files are argv[1..n_files] */
    if (!n_files) {
        fprintf(stderr, "kvmatch analyze: no records file given\n");
        return km_cli_usage_error("analyze");
    }
    km_analysis *analysis = NULL;
    int rc = km_analysis_create(NULL, &analysis);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch analyze: %s\n", km_strerror(rc));
        return 1;
    }
    int readable = 0, status = 0;
    for (int i = 1; i <= n_files; i++) {
        rc = km_analysis_add_file(analysis, argv[i]);
        if (rc == KM_OK) {
            readable++;
        } else if (rc == KM_ERR_IO) {
            fprintf(stderr, "kvmatch analyze: %s\n", km_analysis_last_error(analysis));
        } else {
            fprintf(stderr, "kvmatch analyze: %s: %s\n", km_error_name(rc),
                    km_analysis_last_error(analysis));
            status = 1;
            goto out;
        }
    }
    if (!readable) {
        fprintf(stderr, "kvmatch analyze: no file could be read\n");
        status = 1;
        goto out;
    }
    rc = km_analysis_finish(analysis);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch analyze: %s: %s\n", km_error_name(rc), km_analysis_last_error(analysis));
        status = 1;
        goto out;
    }
    km_text report;
    km_text_init(&report, 0);
    rc = json ? km_analysis_render_json(analysis, &report) : km_analysis_render_text(analysis, &report);
    /* a report smaller than stdout's buffer fails only when flushed */
    if (rc == KM_OK && (fwrite(report.data, 1, report.length, stdout) != report.length ||
                        fflush(stdout) != 0 || ferror(stdout)))
        rc = KM_ERR_IO;
    km_text_free(&report);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch analyze: writing the report: %s\n", km_strerror(rc));
        status = 1;
        goto out;
    }
    if (html) {
        rc = km_analysis_write_html(analysis, html);
        if (rc != KM_OK) {
            fprintf(stderr, "kvmatch analyze: %s\n", km_analysis_last_error(analysis));
            status = 1;
        }
    }
    const km_analysis_input *in = &km_analysis_summary_get(analysis)->input;
    if (in->decisions + in->outcomes == 0) {
        fprintf(stderr, "kvmatch analyze: no valid record in the input (%" PRIu64 " lines, %" PRIu64
                " invalid)\n", in->lines, in->invalid);
        status = 1;
    }
out:
    km_analysis_destroy(analysis);
    return status;
}
