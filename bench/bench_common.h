/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the benchmark subcommands (bench/bench_*.c): timing, medians, rounding for
 * JSON output, a silent index log, and the machine description every result carries. */
#ifndef KM_BENCH_COMMON_H
#define KM_BENCH_COMMON_H

#include <jansson.h>
#include <stddef.h>

/* Seconds on the monotonic clock. */
double km_bench_now_s(void);
/* Sort v[0..n) ascending. */
void km_bench_sort(double *v, size_t n);
/* Median of v[0..n) (sorts v in place); n >= 1. */
double km_bench_median(double *v, size_t n);
/* x rounded to a multiple of unit (for readable JSON). */
double km_bench_round_to(double x, double unit);
/* A km_log_fn that drops every line (benchmarks create many indexes). */
void km_bench_quiet_log(void *user, const char *line);
/* {"cpu": model name, "cores", "memory_gib", "loadavg_1min_at_start"}: other work on the machine
 * skews every number, so each result says how busy it was. */
json_t *km_bench_machine_json(void);

#endif
