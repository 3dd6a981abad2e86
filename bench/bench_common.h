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
/* The mean time for a cache line to go from the first CPU this process may run on to the second
 * and back (two threads pinned there, about 10 ms), in nanoseconds; -1 with fewer than two CPUs.
 * On a VM it says whether the two virtual CPUs share a last-level cache right now: the hypervisor
 * may move them between cores that do and cores that do not, and every figure that depends on
 * threads exchanging data moves with it (docs/BENCHMARKS.md, "The machine"). */
double km_bench_cpu_round_trip_ns(void);
/* {"cpu": model name, "cores", "memory_gib", "loadavg_1min_at_start",
 * "cpu_round_trip_ns_at_start"}: other work on the machine and where its CPUs sit skew every
 * number, so each result says how busy it was and how far apart its CPUs were. */
json_t *km_bench_machine_json(void);

#endif
