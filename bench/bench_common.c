/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the benchmark subcommands; see bench_common.h. */
#include "bench_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double km_bench_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void km_bench_sort(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
}

double km_bench_median(double *v, size_t n)
{
    km_bench_sort(v, n);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double km_bench_round_to(double x, double unit)
{
    return unit * (double)(long long)(x / unit + (x >= 0 ? 0.5 : -0.5));
}

void km_bench_quiet_log(void *user, const char *line)
{
    (void)user;
    (void)line;
}

json_t *km_bench_machine_json(void)
{
    char model[256] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            if (!strncmp(line, "model name", 10)) {
                char *c = strchr(line, ':');
                if (c) {
                    c++;
                    while (*c == ' ' || *c == '\t')
                        c++;
                    snprintf(model, sizeof model, "%s", c);
                    model[strcspn(model, "\n")] = '\0';
                }
                break;
            }
        }
        fclose(f);
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    double load[1] = {-1.0};
    if (getloadavg(load, 1) != 1)
        load[0] = -1.0;
    return json_pack("{s:s, s:I, s:f, s:f}", "cpu", model, "cores", (json_int_t)cores, "memory_gib",
                     km_bench_round_to((double)pages * (double)page / (double)(1ull << 30), 0.1),
                     "loadavg_1min_at_start", km_bench_round_to(load[0], 0.01));
}
