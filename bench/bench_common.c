/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the benchmark subcommands; see bench_common.h. */
#include "bench_common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
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

enum { ROUND_TRIPS = 20000 };

typedef struct round_trip {
    _Alignas(64) atomic_int turn; /* odd: the second CPU's move; even: the first's */
    _Alignas(64) atomic_int ready; /* 1: the answering thread runs on its CPU; -1: it cannot */
    int cpu;
} round_trip;

static int pin_to(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer_round_trips(void *p)
{
    round_trip *rt = p;
    int pinned = pin_to(rt->cpu) == 0;
    atomic_store_explicit(&rt->ready, pinned ? 1 : -1, memory_order_release);
    for (int i = 0; pinned && i < ROUND_TRIPS; i++) {
        while (atomic_load_explicit(&rt->turn, memory_order_acquire) != 2 * i + 1)
            ;
        atomic_store_explicit(&rt->turn, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

double km_bench_cpu_round_trip_ns(void)
{
    cpu_set_t allowed;
    if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed))
        return -1.0;
    int cpus[2], found = 0;
    for (int c = 0; c < CPU_SETSIZE && found < 2; c++)
        if (CPU_ISSET(c, &allowed))
            cpus[found++] = c;
    if (found < 2)
        return -1.0;
    double ns = -1.0;
    round_trip rt;
    atomic_init(&rt.turn, 0);
    atomic_init(&rt.ready, 0);
    rt.cpu = cpus[1];
    pthread_t other;
    if (pin_to(cpus[0]) == 0 && pthread_create(&other, NULL, answer_round_trips, &rt) == 0) {
        int ready;
        while ((ready = atomic_load_explicit(&rt.ready, memory_order_acquire)) == 0)
            sched_yield();
        if (ready == 1) {
            double t0 = km_bench_now_s();
            for (int i = 0; i < ROUND_TRIPS; i++) {
                atomic_store_explicit(&rt.turn, 2 * i + 1, memory_order_release);
                while (atomic_load_explicit(&rt.turn, memory_order_acquire) != 2 * i + 2)
                    ;
            }
            ns = (km_bench_now_s() - t0) * 1e9 / ROUND_TRIPS;
        }
        pthread_join(other, NULL);
    }
    pthread_setaffinity_np(pthread_self(), sizeof allowed, &allowed);
    return ns;
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
    return json_pack("{s:s, s:I, s:f, s:f, s:f}", "cpu", model, "cores", (json_int_t)cores,
                     "memory_gib",
                     km_bench_round_to((double)pages * (double)page / (double)(1ull << 30), 0.1),
                     "loadavg_1min_at_start", km_bench_round_to(load[0], 0.01),
                     "cpu_round_trip_ns_at_start", km_bench_round_to(km_bench_cpu_round_trip_ns(), 1));
}
