/* SPDX-License-Identifier: Apache-2.0 */
/* Metrics (include/kvmatch/metrics.h) and the HTTP probe/scrape server (src/service/http.h).
 *
 * Suite `metrics`: the exposition text checked line by line (family headers, cumulative buckets,
 * +Inf == _count, _sum, escaping of label values and help text, number formatting) against
 * brute-force counts of random observations; exact totals of concurrent updates from 4 threads;
 * quantile estimates against the true quantile of a sorted random sample (same bucket); every
 * registration error with its code and message; the growing text and caller-buffer rendering.
 *
 * Suite `http`: a real server on 127.0.0.1 port 0, fetched with a minimal HTTP/1.1 client written
 * here (plain socket, Connection: close): every route, readiness flipping 503 -> 200, 404, 405,
 * 413, HEAD, failing callbacks (500), non-loopback and malformed bind addresses refused, a port
 * in use, concurrent scrapes while counters move, and a stop with clients connected that returns
 * within a bound. /metrics output is also checked by an independent Python parser when python3 is
 * installed. Randomized tests print their seed (KM_TEST_SEED). */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "service/http.h"
#include "kvmatch/metrics.h"
#include "test_util.h"

/* ---- helpers ----------------------------------------------------------------------------------- */

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Lines of a rendered text (a copy, split in place). */
typedef struct lines {
    char *buffer;
    char **line;
    size_t count;
} lines;

static lines split_lines(const char *text)
{
    lines l = {0};
    l.buffer = strdup(text);
    cr_assert_not_null(l.buffer);
    size_t capacity = 16;
    l.line = malloc(capacity * sizeof *l.line);
    for (char *p = l.buffer; *p;) {
        char *end = strchr(p, '\n');
        cr_assert_not_null(end, "text does not end with a newline: ...%s", p);
        *end = '\0';
        if (l.count == capacity) {
            capacity *= 2;
            l.line = realloc(l.line, capacity * sizeof *l.line);
        }
        l.line[l.count++] = p;
        p = end + 1;
    }
    return l;
}

static void free_lines(lines *l)
{
    free(l->buffer);
    free(l->line);
}

/* The line that starts with `prefix` followed by a space; its value text; NULL when none. */
static const char *sample_value(const lines *l, const char *prefix)
{
    size_t n = strlen(prefix);
    for (size_t i = 0; i < l->count; i++)
        if (strncmp(l->line[i], prefix, n) == 0 && l->line[i][n] == ' ')
            return l->line[i] + n + 1;
    return NULL;
}

static char *render(km_metrics *m)
{
    km_text t;
    km_text_init(&t, 0);
    cr_assert_eq(km_metrics_render(m, &t), KM_OK);
    char *copy = strdup(km_text_cstr(&t));
    km_text_free(&t);
    return copy;
}

/* ---- metrics: rendering ------------------------------------------------------------------------ */

Test(metrics, counter_and_gauge_render_exactly, .timeout = 30)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_counter *routed, *failed;
    km_metric_label kv[] = {{"policy", "kv"}};
    km_metric_label rr[] = {{"policy", "round_robin"}};
    cr_assert_eq(km_metrics_add_counter(m, "kvmatch_decisions_total", "Decisions made.", kv, 1,
                                        &routed), KM_OK);
    cr_assert_eq(km_metrics_add_counter(m, "kvmatch_decisions_total", "Decisions made.", rr, 1,
                                        &failed), KM_OK);
    km_gauge *workers;
    cr_assert_eq(km_metrics_add_gauge(m, "kvmatch_workers", "Workers known.", NULL, 0, &workers),
                 KM_OK);
    km_counter_add(routed, 41);
    km_counter_increment(routed);
    km_counter_add(failed, UINT64_C(18446744073709551615)); /* the largest u64 prints exactly */
    km_gauge_set(workers, 12);
    km_gauge_add(workers, -2.5);
    cr_assert_eq(km_counter_value(routed), 42);
    cr_assert_eq(km_gauge_value(workers), 9.5);
    char *text = render(m);
    const char *expected = "# HELP kvmatch_decisions_total Decisions made.\n"
                           "# TYPE kvmatch_decisions_total counter\n"
                           "kvmatch_decisions_total{policy=\"kv\"} 42\n"
                           "kvmatch_decisions_total{policy=\"round_robin\"} 18446744073709551615\n"
                           "# HELP kvmatch_workers Workers known.\n"
                           "# TYPE kvmatch_workers gauge\n"
                           "kvmatch_workers 9.5\n";
    cr_assert_str_eq(text, expected);
    free(text);
    km_metrics_destroy(m);
}

Test(metrics, same_series_registered_twice_is_one_handle, .timeout = 30)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_metric_label a[] = {{"worker", "3"}, {"state", "LIVE"}};
    km_metric_label b[] = {{"worker", "3"}, {"state", "LIVE"}};
    km_gauge *g1, *g2, *g3;
    cr_assert_eq(km_metrics_add_gauge(m, "kvmatch_worker_state", "h", a, 2, &g1), KM_OK);
    cr_assert_eq(km_metrics_add_gauge(m, "kvmatch_worker_state", "h", b, 2, &g2), KM_OK);
    cr_assert_eq(g1, g2);
    km_metric_label c[] = {{"worker", "3"}, {"state", "GAP"}};
    cr_assert_eq(km_metrics_add_gauge(m, "kvmatch_worker_state", "h", c, 2, &g3), KM_OK);
    cr_assert_neq(g1, g3);
    km_histogram *h1, *h2;
    size_t nb;
    const double *bounds = km_metrics_batch_size_buckets(&nb);
    cr_assert_eq(km_metrics_add_histogram(m, "kvmatch_batch_size", "h", NULL, 0, bounds, nb, &h1),
                 KM_OK);
    cr_assert_eq(km_metrics_add_histogram(m, "kvmatch_batch_size", "h", NULL, 0, bounds, nb, &h2),
                 KM_OK);
    cr_assert_eq(h1, h2);
    char *text = render(m);
    /* One family header for the two gauge series. */
    cr_assert_eq(strstr(strstr(text, "# TYPE kvmatch_worker_state gauge") + 1,
                        "# TYPE kvmatch_worker_state"), NULL);
    cr_assert_neq(strstr(text, "kvmatch_worker_state{worker=\"3\",state=\"LIVE\"} 0\n"
                               "kvmatch_worker_state{worker=\"3\",state=\"GAP\"} 0\n"), NULL);
    free(text);
    km_metrics_destroy(m);
}

Test(metrics, label_values_and_help_are_escaped, .timeout = 30)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_metric_label labels[] = {{"worker", "a\"b\\c\nd"}, {"model", "llama \"3\" \\ 8B"}};
    km_counter *c;
    cr_assert_eq(km_metrics_add_counter(m, "x_total", "line one\nback\\slash \"quoted\"", labels, 2,
                                        &c), KM_OK);
    km_counter_add(c, 7);
    char *text = render(m);
    lines l = split_lines(text);
    cr_assert_eq(l.count, 3, "%s", text);
    /* Help: backslash and newline escaped, quotes left as they are. */
    cr_assert_str_eq(l.line[0], "# HELP x_total line one\\nback\\\\slash \"quoted\"");
    cr_assert_str_eq(l.line[1], "# TYPE x_total counter");
    cr_assert_str_eq(l.line[2],
                     "x_total{worker=\"a\\\"b\\\\c\\nd\",model=\"llama \\\"3\\\" \\\\ 8B\"} 7");
    free_lines(&l);
    free(text);

    /* The same escaping through the direct writers. */
    km_text t;
    km_text_init(&t, 0);
    km_metric_label odd[] = {{"path", "C:\\tmp\n\"x\""}};
    cr_assert_eq(km_prom_write_family(&t, "y", "a\\b\nc", KM_METRIC_GAUGE), KM_OK);
    cr_assert_eq(km_prom_write_sample(&t, "y", odd, 1, 0.25), KM_OK);
    cr_assert_eq(km_prom_write_sample_u64(&t, "y", NULL, 0, 3), KM_OK);
    cr_assert_str_eq(km_text_cstr(&t), "# HELP y a\\\\b\\nc\n# TYPE y gauge\n"
                                       "y{path=\"C:\\\\tmp\\n\\\"x\\\"\"} 0.25\ny 3\n");
    /* Invalid names write nothing. */
    size_t before = t.length;
    cr_assert_eq(km_prom_write_sample(&t, "9bad", NULL, 0, 1), KM_ERR_INVALID_ARGUMENT);
    km_metric_label bad[] = {{"__reserved", "v"}};
    cr_assert_eq(km_prom_write_sample(&t, "ok", bad, 1, 1), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_prom_write_family(&t, "a-b", "", KM_METRIC_GAUGE), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(t.length, before);
    km_text_free(&t);
    km_metrics_destroy(m);
}

Test(metrics, numbers_print_exactly, .timeout = 30)
{
    km_text t;
    km_text_init(&t, 0);
    double values[] = {0.1,  1e-5, 2.5e-5,   123456789.125, 1e300, -0.0,
                       3,    NAN,  INFINITY, -INFINITY,     800000, 1e15};
    for (size_t i = 0; i < sizeof values / sizeof values[0]; i++)
        cr_assert_eq(km_prom_write_sample(&t, "v", NULL, 0, values[i]), KM_OK);
    lines l = split_lines(km_text_cstr(&t));
    const char *expected[] = {"v 0.1", "v 1e-05", "v 2.5e-05", "v 123456789.125", "v 1e+300",
                              "v -0", "v 3", "v NaN", "v +Inf", "v -Inf", "v 800000",
                              "v 1e+15"};
    cr_assert_eq(l.count, sizeof expected / sizeof expected[0]);
    for (size_t i = 0; i < l.count; i++)
        cr_assert_str_eq(l.line[i], expected[i]);
    /* Every finite value reads back exactly. */
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    for (int i = 0; i < 2000; i++) {
        uint64_t bits = km_rng_next(&rng);
        double v;
        memcpy(&v, &bits, sizeof v);
        if (!isfinite(v))
            continue;
        km_text_clear(&t);
        km_prom_write_sample(&t, "v", NULL, 0, v);
        KM_CHECK(strtod(km_text_cstr(&t) + 2, NULL) == v, "%.17g printed as %s", v,
                 km_text_cstr(&t));
    }
    free_lines(&l);
    km_text_free(&t);
}

/* Parse "<name>_bucket{<prefix>le="B"} N" lines of one histogram series into arrays. */
static size_t parse_buckets(const lines *l, const char *series_prefix, double *le, uint64_t *counts,
                            size_t max)
{
    size_t n = 0, plen = strlen(series_prefix);
    for (size_t i = 0; i < l->count; i++) {
        const char *line = l->line[i];
        if (strncmp(line, series_prefix, plen) != 0)
            continue;
        const char *p = line + plen;
        cr_assert_eq(strncmp(p, "le=\"", 4), 0, "bucket line without le: %s", line);
        p += 4;
        const char *close = strchr(p, '"');
        cr_assert_not_null(close);
        char bound[64];
        snprintf(bound, sizeof bound, "%.*s", (int)(close - p), p);
        cr_assert(n < max);
        le[n] = strcmp(bound, "+Inf") == 0 ? INFINITY : strtod(bound, NULL);
        cr_assert_eq(strncmp(close, "\"} ", 3), 0, "%s", line);
        counts[n] = strtoull(close + 3, NULL, 10);
        n++;
    }
    return n;
}

Test(metrics, histogram_lines_against_brute_force, .timeout = 30)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    size_t nb;
    const double *bounds = km_metrics_latency_buckets_seconds(&nb);
    cr_assert_eq(nb, 16);
    cr_assert_eq(bounds[0], 1e-5);
    cr_assert_eq(bounds[nb - 1], 1.0);
    km_metric_label labels[] = {{"pool", "chat\"a\""}};
    km_histogram *h;
    cr_assert_eq(km_metrics_add_histogram(m, "kvmatch_rtt_seconds", "Round trips.", labels, 1,
                                          bounds, nb, &h), KM_OK);
    size_t n = 1 + km_rng_below(&rng, 5000);
    double *values = malloc(n * sizeof *values);
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        /* Log-uniform over 1 us .. 4 s, some values exactly on a bound. */
        double v = km_rng_percent(&rng, 10) ? bounds[km_rng_below(&rng, (uint32_t)nb)]
                                            : 1e-6 * pow(4e6, (double)km_rng_below(&rng, 1000000) / 1e6);
        values[i] = v;
        sum += v;
        km_histogram_observe(h, v);
    }
    km_histogram_observe(h, NAN); /* ignored */
    cr_assert_eq(km_histogram_count(h), n);
    char *text = render(m);
    lines l = split_lines(text);
    cr_assert_str_eq(l.line[0], "# HELP kvmatch_rtt_seconds Round trips.");
    cr_assert_str_eq(l.line[1], "# TYPE kvmatch_rtt_seconds histogram");
    double le[64];
    uint64_t counts[64];
    size_t got = parse_buckets(&l, "kvmatch_rtt_seconds_bucket{pool=\"chat\\\"a\\\"\",", le, counts,
                               64);
    cr_assert_eq(got, nb + 1, "%s", text);
    for (size_t b = 0; b <= nb; b++) {
        uint64_t expected = 0;
        for (size_t i = 0; i < n; i++)
            expected += values[i] <= le[b];
        KM_CHECK(counts[b] == expected, "bucket le=%g: %" PRIu64 " rendered, %" PRIu64 " true",
                 le[b], counts[b], expected);
        if (b < nb)
            cr_assert_eq(le[b], bounds[b], "le text must read back as the bound");
        if (b)
            cr_assert(counts[b] >= counts[b - 1] && le[b] > le[b - 1]);
    }
    cr_assert(isinf(le[nb]));
    cr_assert_eq(counts[nb], n, "+Inf bucket must equal the count");
    const char *count_text = sample_value(&l, "kvmatch_rtt_seconds_count{pool=\"chat\\\"a\\\"\"}");
    const char *sum_text = sample_value(&l, "kvmatch_rtt_seconds_sum{pool=\"chat\\\"a\\\"\"}");
    cr_assert_not_null(count_text, "%s", text);
    cr_assert_not_null(sum_text, "%s", text);
    cr_assert_eq(strtoull(count_text, NULL, 10), n);
    /* Same additions in the same order on one thread: the same double. */
    KM_CHECK(strtod(sum_text, NULL) == sum, "sum %s, expected %.17g", sum_text, sum);
    cr_assert_eq(l.count, 2 + (nb + 1) + 2);
    free_lines(&l);
    free(text);
    free(values);
    km_metrics_destroy(m);
}

typedef struct hammer_args {
    km_counter *counter;
    km_gauge *gauge;
    km_histogram *histogram;
    km_metrics *registry;
    int thread;
    atomic_int *go;
} hammer_args;

#define HAMMER_ROUNDS 200000

static void *hammer(void *p)
{
    hammer_args *a = p;
    while (!atomic_load(a->go))
        ;
    for (int i = 0; i < HAMMER_ROUNDS; i++) {
        km_counter_increment(a->counter);
        km_gauge_add(a->gauge, 1.0);
        km_histogram_observe(a->histogram, (double)((i + a->thread) % 8)); /* integers: exact sums */
        if (i % 50000 == 0) { /* renders and registrations race with the updates */
            km_text t;
            km_text_init(&t, 0);
            km_metrics_render(a->registry, &t);
            km_text_free(&t);
            char name[32];
            snprintf(name, sizeof name, "%d", i);
            km_metric_label label = {"round", name};
            km_counter *extra;
            km_metrics_add_counter(a->registry, "extra_total", "", &label, 1, &extra);
            km_counter_increment(extra);
        }
    }
    return NULL;
}

Test(metrics, concurrent_updates_sum_exactly, .timeout = 60)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_counter *c;
    km_gauge *g;
    km_histogram *h;
    double bounds[] = {1, 3, 5};
    cr_assert_eq(km_metrics_add_counter(m, "c_total", "", NULL, 0, &c), KM_OK);
    cr_assert_eq(km_metrics_add_gauge(m, "g", "", NULL, 0, &g), KM_OK);
    cr_assert_eq(km_metrics_add_histogram(m, "h", "", NULL, 0, bounds, 3, &h), KM_OK);
    atomic_int go;
    atomic_init(&go, 0);
    pthread_t threads[4];
    hammer_args args[4];
    for (int t = 0; t < 4; t++) {
        args[t] = (hammer_args){c, g, h, m, t, &go};
        cr_assert_eq(pthread_create(&threads[t], NULL, hammer, &args[t]), 0);
    }
    atomic_store(&go, 1);
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);
    uint64_t total = 4u * HAMMER_ROUNDS;
    cr_assert_eq(km_counter_value(c), total);
    cr_assert_eq(km_gauge_value(g), (double)total);
    cr_assert_eq(km_histogram_count(h), total);
    /* Each thread observes (i + t) % 8 over 200000 rounds: 25000 of each of 0..7. */
    cr_assert_eq(km_histogram_sum(h), 4.0 * 25000 * (0 + 1 + 2 + 3 + 4 + 5 + 6 + 7));
    char *text = render(m);
    lines l = split_lines(text);
    cr_assert_str_eq(sample_value(&l, "c_total"), "800000");
    cr_assert_str_eq(sample_value(&l, "g"), "800000");
    cr_assert_str_eq(sample_value(&l, "h_bucket{le=\"1\"}"), "200000");  /* 0, 1 */
    cr_assert_str_eq(sample_value(&l, "h_bucket{le=\"3\"}"), "400000");  /* 0..3 */
    cr_assert_str_eq(sample_value(&l, "h_bucket{le=\"5\"}"), "600000");  /* 0..5 */
    cr_assert_str_eq(sample_value(&l, "h_bucket{le=\"+Inf\"}"), "800000");
    cr_assert_str_eq(sample_value(&l, "h_count"), "800000");
    cr_assert_str_eq(sample_value(&l, "extra_total{round=\"0\"}"), "4");
    cr_assert_str_eq(sample_value(&l, "extra_total{round=\"150000\"}"), "4");
    free_lines(&l);
    free(text);
    km_metrics_destroy(m);
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

Test(metrics, quantile_lands_in_the_true_quantile_bucket, .timeout = 30)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    size_t nb;
    const double *bounds = km_metrics_latency_buckets_seconds(&nb);
    for (int trial = 0; trial < 40; trial++) {
        km_metrics *m;
        cr_assert_eq(km_metrics_create(&m), KM_OK);
        km_histogram *h;
        cr_assert_eq(km_metrics_add_histogram(m, "lat", "", NULL, 0, bounds, nb, &h), KM_OK);
        cr_assert(isnan(km_histogram_quantile(h, 0.5)), "empty histogram: NaN");
        size_t n = 1 + km_rng_below(&rng, trial < 10 ? 5 : 3000);
        double *sample = malloc(n * sizeof *sample);
        /* Values clustered around a random centre, sometimes beyond the last bound. */
        double centre = 1e-5 * pow(2e5, (double)km_rng_below(&rng, 1000) / 1000.0);
        for (size_t i = 0; i < n; i++) {
            sample[i] = centre * pow(10, ((double)km_rng_below(&rng, 2001) - 1000.0) / 1000.0);
            km_histogram_observe(h, sample[i]);
        }
        qsort(sample, n, sizeof *sample, compare_doubles);
        double qs[] = {0, 0.01, 0.5, 0.9, 0.99, 0.999, 1,
                       (double)km_rng_below(&rng, 1001) / 1000.0};
        for (size_t k = 0; k < sizeof qs / sizeof qs[0]; k++) {
            double q = qs[k];
            size_t rank = (size_t)ceil(q * (double)n);
            if (rank < 1)
                rank = 1;
            double truth = sample[rank - 1];
            /* The bucket holding the true value: (lower, upper]. */
            size_t b = 0;
            while (b < nb && truth > bounds[b])
                b++;
            double estimate = km_histogram_quantile(h, q);
            if (b == nb) {
                KM_CHECK(estimate == bounds[nb - 1], "q=%g n=%zu: truth %g above all bounds, "
                         "estimate %g", q, n, truth, estimate);
                continue;
            }
            double lower = b ? bounds[b - 1] : 0, upper = bounds[b];
            KM_CHECK(estimate >= lower && estimate <= upper,
                     "q=%g n=%zu: truth %g in (%g, %g], estimate %g", q, n, truth, lower, upper,
                     estimate);
        }
        cr_assert(isnan(km_histogram_quantile(h, -0.1)));
        cr_assert(isnan(km_histogram_quantile(h, 1.5)));
        cr_assert(isnan(km_histogram_quantile(h, NAN)));
        free(sample);
        km_metrics_destroy(m);
    }
    cr_assert(isnan(km_histogram_quantile(NULL, 0.5)));
}

Test(metrics, quantile_interpolates_inside_a_bucket, .timeout = 30)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    double bounds[] = {10, 20, 30};
    km_histogram *h;
    cr_assert_eq(km_metrics_add_histogram(m, "x", "", NULL, 0, bounds, 3, &h), KM_OK);
    for (int i = 0; i < 10; i++)
        km_histogram_observe(h, 15); /* all in (10, 20] */
    cr_assert_float_eq(km_histogram_quantile(h, 0.5), 15.0, 1e-12);
    cr_assert_float_eq(km_histogram_quantile(h, 1.0), 20.0, 1e-12);
    cr_assert_float_eq(km_histogram_quantile(h, 0.0), 10.0, 1e-12);
    km_histogram_observe(h, 1000); /* +Inf bucket: the top bound is the answer */
    cr_assert_eq(km_histogram_quantile(h, 1.0), 30.0);
    km_metrics_destroy(m);
}

Test(metrics, registration_errors_have_codes_and_messages, .timeout = 30)
{
    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_counter *c = (km_counter *)1;
    km_gauge *g;
    km_histogram *h;
    double bounds[] = {1, 2};
    km_metric_label one[] = {{"worker", "1"}};

#define EXPECT_FAIL(call, code, needle)                                                       \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        cr_assert_eq(rc_, (code), "%s returned %s", #call, km_error_name(rc_));                \
        cr_assert_neq(strstr(km_metrics_last_error(m), (needle)), NULL, "message: %s",         \
                      km_metrics_last_error(m));                                                \
        cr_assert_neq(strstr(km_metrics_last_error(m), km_error_name(code)), NULL);             \
    } while (0)

    EXPECT_FAIL(km_metrics_add_counter(m, "9lives", "", NULL, 0, &c), KM_ERR_INVALID_ARGUMENT,
                "not [a-zA-Z_:]");
    cr_assert_null(c, "*out is NULL on failure");
    EXPECT_FAIL(km_metrics_add_counter(m, "", "", NULL, 0, &c), KM_ERR_INVALID_ARGUMENT, "metric name");
    EXPECT_FAIL(km_metrics_add_counter(m, "a b", "", NULL, 0, &c), KM_ERR_INVALID_ARGUMENT, "a b");
    km_metric_label bad_name[] = {{"wor-ker", "1"}};
    EXPECT_FAIL(km_metrics_add_counter(m, "a", "", bad_name, 1, &c), KM_ERR_INVALID_ARGUMENT,
                "wor-ker");
    km_metric_label reserved[] = {{"__name__", "1"}};
    EXPECT_FAIL(km_metrics_add_counter(m, "a", "", reserved, 1, &c), KM_ERR_INVALID_ARGUMENT, "__");
    km_metric_label le[] = {{"le", "1"}};
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", le, 1, &g), KM_ERR_INVALID_ARGUMENT, "reserved");
    km_metric_label twice[] = {{"w", "1"}, {"w", "2"}};
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", twice, 2, &g), KM_ERR_INVALID_ARGUMENT, "twice");
    km_metric_label null_value[] = {{"w", NULL}};
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", null_value, 1, &g), KM_ERR_NULL_POINTER, "NULL");
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", NULL, 2, &g), KM_ERR_NULL_POINTER, "NULL");

    km_metric_label many[KM_METRICS_LABELS_MAX + 1];
    char names[KM_METRICS_LABELS_MAX + 1][8];
    for (size_t i = 0; i <= KM_METRICS_LABELS_MAX; i++) {
        snprintf(names[i], sizeof names[i], "l%zu", i);
        many[i] = (km_metric_label){names[i], "v"};
    }
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", many, KM_METRICS_LABELS_MAX + 1, &g),
                KM_ERR_TOO_LARGE, "labels");
    char long_name[KM_METRICS_NAME_MAX + 2];
    memset(long_name, 'a', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    EXPECT_FAIL(km_metrics_add_gauge(m, long_name, "", NULL, 0, &g), KM_ERR_TOO_LARGE, "longer");
    char long_value[KM_METRICS_LABEL_VALUE_MAX + 2];
    memset(long_value, 'v', sizeof long_value - 1);
    long_value[sizeof long_value - 1] = '\0';
    km_metric_label long_label[] = {{"w", long_value}};
    EXPECT_FAIL(km_metrics_add_gauge(m, "a", "", long_label, 1, &g), KM_ERR_TOO_LARGE, "longer");

    double descending[] = {2, 1};
    double with_nan[] = {1, NAN};
    double with_inf[] = {1, INFINITY};
    EXPECT_FAIL(km_metrics_add_histogram(m, "h", "", NULL, 0, descending, 2, &h),
                KM_ERR_INVALID_ARGUMENT, "ascending");
    EXPECT_FAIL(km_metrics_add_histogram(m, "h", "", NULL, 0, with_nan, 2, &h),
                KM_ERR_INVALID_ARGUMENT, "finite");
    EXPECT_FAIL(km_metrics_add_histogram(m, "h", "", NULL, 0, with_inf, 2, &h),
                KM_ERR_INVALID_ARGUMENT, "finite");
    EXPECT_FAIL(km_metrics_add_histogram(m, "h", "", NULL, 0, bounds, 0, &h),
                KM_ERR_INVALID_ARGUMENT, "at least one");
    double too_many[KM_METRICS_BUCKETS_MAX + 1];
    for (size_t i = 0; i <= KM_METRICS_BUCKETS_MAX; i++)
        too_many[i] = (double)i;
    EXPECT_FAIL(km_metrics_add_histogram(m, "h", "", NULL, 0, too_many, KM_METRICS_BUCKETS_MAX + 1,
                                         &h), KM_ERR_TOO_LARGE, "bucket bounds");

    /* Conflicts with an existing family. */
    cr_assert_eq(km_metrics_add_counter(m, "fam_total", "help", one, 1, &c), KM_OK);
    EXPECT_FAIL(km_metrics_add_gauge(m, "fam_total", "help", one, 1, &g), KM_ERR_INVALID_ARGUMENT,
                "already registered as a counter");
    EXPECT_FAIL(km_metrics_add_counter(m, "fam_total", "other", one, 1, &c),
                KM_ERR_INVALID_ARGUMENT, "help");
    km_metric_label other[] = {{"pool", "1"}};
    EXPECT_FAIL(km_metrics_add_counter(m, "fam_total", "help", other, 1, &c),
                KM_ERR_INVALID_ARGUMENT, "same label names");
    EXPECT_FAIL(km_metrics_add_counter(m, "fam_total", "help", NULL, 0, &c),
                KM_ERR_INVALID_ARGUMENT, "same label names");
    cr_assert_eq(km_metrics_add_histogram(m, "hist", "", NULL, 0, bounds, 2, &h), KM_OK);
    double other_bounds[] = {1, 3};
    EXPECT_FAIL(km_metrics_add_histogram(m, "hist", "", NULL, 0, other_bounds, 2, &h),
                KM_ERR_INVALID_ARGUMENT, "bucket bounds");
    cr_assert_eq(km_metrics_add_counter(NULL, "x", "", NULL, 0, &c), KM_ERR_NULL_POINTER);
    EXPECT_FAIL(km_metrics_add_counter(m, NULL, "", NULL, 0, &c), KM_ERR_NULL_POINTER, "NULL");
    EXPECT_FAIL(km_metrics_add_counter(m, "x", "", NULL, 0, NULL), KM_ERR_NULL_POINTER, "NULL");
#undef EXPECT_FAIL

    /* Nothing failed left a trace: exactly the two good families render. */
    char *text = render(m);
    cr_assert_str_eq(text, "# HELP fam_total help\n# TYPE fam_total counter\n"
                           "fam_total{worker=\"1\"} 0\n"
                           "# HELP hist \n# TYPE hist histogram\n"
                           "hist_bucket{le=\"1\"} 0\nhist_bucket{le=\"2\"} 0\n"
                           "hist_bucket{le=\"+Inf\"} 0\nhist_sum 0\nhist_count 0\n");
    free(text);
    /* NULL handles are no-ops. */
    km_counter_add(NULL, 1);
    km_gauge_set(NULL, 1);
    km_gauge_add(NULL, 1);
    km_histogram_observe(NULL, 1);
    cr_assert_eq(km_counter_value(NULL), 0);
    km_metrics_destroy(m);
    km_metrics_destroy(NULL);
}

Test(metrics, text_limits_and_buffer_rendering, .timeout = 30)
{
    km_text t;
    km_text_init(&t, 10);
    cr_assert_str_eq(km_text_cstr(&t), "");
    cr_assert_eq(km_text_append_cstr(&t, "0123456789"), KM_OK);
    cr_assert_eq(km_text_append_cstr(&t, "x"), KM_ERR_TOO_LARGE);
    cr_assert_eq(km_text_printf(&t, "%d", 1), KM_ERR_TOO_LARGE, "the failure is sticky");
    cr_assert_str_eq(km_text_cstr(&t), "0123456789");
    km_text_clear(&t);
    cr_assert_eq(km_text_printf(&t, "%s-%d", "ab", 7), KM_OK);
    cr_assert_str_eq(km_text_cstr(&t), "ab-7");
    km_text_free(&t);

    km_text big;
    km_text_init(&big, 0);
    char chunk[1000];
    memset(chunk, 'z', sizeof chunk - 1);
    chunk[sizeof chunk - 1] = '\0';
    for (int i = 0; i < 100; i++)
        cr_assert_eq(km_text_printf(&big, "%s%d", chunk, i % 10), KM_OK);
    cr_assert_eq(big.length, 100u * 1000u);
    cr_assert_eq(big.data[999], '0');
    cr_assert_eq(big.data[100u * 1000u - 1], '9');
    km_text_free(&big);

    km_metrics *m;
    cr_assert_eq(km_metrics_create(&m), KM_OK);
    km_gauge *g;
    cr_assert_eq(km_metrics_add_gauge(m, "g", "h", NULL, 0, &g), KM_OK);
    const char *full = "# HELP g h\n# TYPE g gauge\ng 0\n";
    size_t needed = 0;
    char buffer[64];
    cr_assert_eq(km_metrics_render_to_buffer(m, buffer, 8, &needed), KM_ERR_TOO_LARGE);
    cr_assert_eq(needed, strlen(full) + 1);
    cr_assert_str_eq(buffer, "# HELP ");
    cr_assert_eq(km_metrics_render_to_buffer(m, buffer, needed - 1, &needed), KM_ERR_TOO_LARGE);
    cr_assert_eq(km_metrics_render_to_buffer(m, buffer, needed, &needed), KM_OK);
    cr_assert_str_eq(buffer, full);
    cr_assert_eq(km_metrics_render_to_buffer(m, NULL, 0, &needed), KM_ERR_TOO_LARGE);
    cr_assert_eq(km_metrics_render(NULL, &big), KM_ERR_NULL_POINTER);
    km_metrics_destroy(m);

    size_t n;
    const double *b = km_metrics_batch_size_buckets(&n);
    cr_assert_eq(n, 13);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(b[i], (double)(1u << i));
}

/* ---- a minimal HTTP/1.1 client ----------------------------------------------------------------- */

typedef struct http_reply {
    int status;       /* 0 when no status line came */
    char headers[2048];
    char *body;       /* malloc'd, NUL-terminated */
    size_t body_length;
} http_reply;

static int connect_loopback(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
    return fd;
}

static void send_all(int fd, const char *data, size_t length)
{
    while (length) {
        ssize_t n = send(fd, data, length, MSG_NOSIGNAL);
        cr_assert(n > 0, "send: %s", strerror(errno));
        data += n;
        length -= (size_t)n;
    }
}

/* Send `request` verbatim, read to EOF, parse. */
static http_reply http_raw(uint16_t port, const char *request)
{
    int fd = connect_loopback(port);
    send_all(fd, request, strlen(request));
    size_t capacity = 4096, length = 0;
    char *data = malloc(capacity);
    for (;;) {
        if (length + 1024 > capacity) {
            capacity *= 2;
            data = realloc(data, capacity);
        }
        ssize_t n = recv(fd, data + length, capacity - length - 1, 0);
        if (n < 0 && errno == EINTR)
            continue;
        cr_assert(n >= 0, "recv: %s", strerror(errno));
        if (n == 0)
            break;
        length += (size_t)n;
    }
    close(fd);
    data[length] = '\0';
    http_reply r = {0};
    sscanf(data, "HTTP/1.%*d %d", &r.status);
    char *end = strstr(data, "\r\n\r\n");
    cr_assert_not_null(end, "no header end in: %s", data);
    snprintf(r.headers, sizeof r.headers, "%.*s", (int)(end - data), data);
    r.body_length = length - (size_t)(end + 4 - data);
    r.body = malloc(r.body_length + 1);
    memcpy(r.body, end + 4, r.body_length);
    r.body[r.body_length] = '\0';
    free(data);
    return r;
}

static http_reply http_get(uint16_t port, const char *method, const char *path)
{
    char request[512];
    snprintf(request, sizeof request,
             "%s %s HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nConnection: close\r\n\r\n", method, path,
             (unsigned)port);
    return http_raw(port, request);
}

/* The value of header `name` (case-insensitive), copied into out; "" when absent. */
static const char *header_value(const http_reply *r, const char *name, char *out, size_t size)
{
    out[0] = '\0';
    size_t n = strlen(name);
    for (const char *line = strstr(r->headers, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        const char *p = line + 2;
        if (strncasecmp(p, name, n) == 0 && p[n] == ':') {
            p += n + 1;
            while (*p == ' ')
                p++;
            const char *e = strstr(p, "\r\n");
            size_t len = e ? (size_t)(e - p) : strlen(p);
            snprintf(out, size, "%.*s", (int)len, p);
            break;
        }
    }
    return out;
}

static void free_reply(http_reply *r)
{
    free(r->body);
}

/* ---- http: the service side of the tests ------------------------------------------------------- */

typedef struct service {
    atomic_int ready;
    atomic_int fail_status;
    atomic_int fail_metrics;
    atomic_int calls;
    km_metrics *metrics;
    km_counter *decisions;
    km_text log; /* libmicrohttpd's lines, written on its thread; read after km_http_stop */
} service;

static void collect_log(void *user, const char *line)
{
    km_text_printf(user, "%s\n", line);
}

static bool service_readiness(void *user, km_text *reason)
{
    service *s = user;
    atomic_fetch_add(&s->calls, 1);
    bool ready = atomic_load(&s->ready);
    km_text_printf(reason, "%d/4 workers LIVE, need 75%%", ready ? 3 : 1);
    return ready;
}

static int service_status(void *user, km_text *json)
{
    service *s = user;
    atomic_fetch_add(&s->calls, 1);
    if (atomic_load(&s->fail_status)) {
        km_text_append_cstr(json, "index is being rebuilt");
        return KM_ERR_INTERNAL;
    }
    km_text_printf(json, "{\"workers\":[{\"id\":0,\"state\":\"LIVE\",\"blocks\":%d}]}", 12);
    return KM_OK;
}

static int service_metrics(void *user, km_text *out)
{
    service *s = user;
    atomic_fetch_add(&s->calls, 1);
    if (atomic_load(&s->fail_metrics)) {
        km_text_append_cstr(out, "feed lock timed out");
        return KM_ERR_TIMEOUT;
    }
    km_prom_write_family(out, "kvmatch_worker_live", "1 when the worker's index state is LIVE.",
                         KM_METRIC_GAUGE);
    km_metric_label w0[] = {{"worker", "0"}, {"state", "LIVE"}};
    km_metric_label w1[] = {{"worker", "1"}, {"state", "GAP"}};
    km_prom_write_sample(out, "kvmatch_worker_live", w0, 2, 1);
    km_prom_write_sample(out, "kvmatch_worker_live", w1, 2, 0);
    return out->status;
}

/* A server on an ephemeral loopback port; idle_timeout_s 0 keeps the default connection
 * timeout. */
static km_http *start_server_idle_timeout(service *s, uint32_t idle_timeout_s)
{
    memset(s, 0, sizeof *s);
    cr_assert_eq(km_metrics_create(&s->metrics), KM_OK);
    cr_assert_eq(km_metrics_add_counter(s->metrics, "kvmatch_decisions_total", "Decisions.", NULL,
                                        0, &s->decisions), KM_OK);
    km_http_config cfg;
    km_http_config_init(&cfg);
    cfg.metrics = s->metrics;
    cfg.callbacks = (km_http_callbacks){s, service_readiness, service_status, service_metrics};
    km_text_init(&s->log, 0);
    cfg.log = collect_log;
    cfg.log_user = &s->log;
    if (idle_timeout_s)
        cfg.connection_timeout_s = idle_timeout_s;
    km_http *http = NULL;
    char error[256];
    int rc = km_http_start(&cfg, &http, error, sizeof error);
    cr_assert_eq(rc, KM_OK, "start: %s", error);
    cr_assert_neq(km_http_port(http), 0);
    cr_assert_str_eq(km_http_bind_address(http), "127.0.0.1");
    return http;
}

static km_http *start_server(service *s)
{
    return start_server_idle_timeout(s, 0);
}

static void stop_server(km_http *http, service *s)
{
    km_http_stop(http);
    km_metrics_destroy(s->metrics);
    km_text_free(&s->log);
}

Test(http, every_route, .timeout = 30)
{
    service s;
    km_http *http = start_server(&s);
    uint16_t port = km_http_port(http);
    char value[256];

    http_reply r = http_get(port, "GET", "/healthz");
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "ok\n");
    cr_assert_str_eq(header_value(&r, "Cache-Control", value, sizeof value), "no-store");
    free_reply(&r);

    r = http_get(port, "GET", "/status");
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(header_value(&r, "Content-Type", value, sizeof value), "application/json");
    cr_assert_str_eq(r.body, "{\"workers\":[{\"id\":0,\"state\":\"LIVE\",\"blocks\":12}]}");
    free_reply(&r);

    km_counter_add(s.decisions, 5);
    r = http_get(port, "GET", "/metrics?debug=1"); /* query strings are ignored */
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(header_value(&r, "Content-Type", value, sizeof value),
                     "text/plain; version=0.0.4; charset=utf-8");
    cr_assert_str_eq(r.body,
                     "# HELP kvmatch_decisions_total Decisions.\n"
                     "# TYPE kvmatch_decisions_total counter\n"
                     "kvmatch_decisions_total 5\n"
                     "# HELP kvmatch_worker_live 1 when the worker's index state is LIVE.\n"
                     "# TYPE kvmatch_worker_live gauge\n"
                     "kvmatch_worker_live{worker=\"0\",state=\"LIVE\"} 1\n"
                     "kvmatch_worker_live{worker=\"1\",state=\"GAP\"} 0\n");
    free_reply(&r);

    r = http_get(port, "HEAD", "/healthz");
    cr_assert_eq(r.status, 200);
    cr_assert_eq(r.body_length, 0, "HEAD has no body");
    free_reply(&r);

    r = http_get(port, "GET", "/nope");
    cr_assert_eq(r.status, 404);
    cr_assert_neq(strstr(r.body, "/healthz"), NULL);
    free_reply(&r);
    r = http_get(port, "GET", "/");
    cr_assert_eq(r.status, 404);
    free_reply(&r);
    r = http_get(port, "GET", "/healthz/extra");
    cr_assert_eq(r.status, 404);
    free_reply(&r);

    const char *methods[] = {"POST", "PUT", "DELETE", "OPTIONS", "PATCH"};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        r = http_get(port, methods[i], "/metrics");
        cr_assert_eq(r.status, 405, "%s", methods[i]);
        cr_assert_str_eq(header_value(&r, "Allow", value, sizeof value), "GET, HEAD");
        free_reply(&r);
    }

    /* A body is refused before it is read. */
    char request[256];
    snprintf(request, sizeof request,
             "GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"
             "hello");
    r = http_raw(port, request);
    cr_assert_eq(r.status, 413);
    free_reply(&r);
    snprintf(request, sizeof request,
             "GET /status HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
             "Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    r = http_raw(port, request);
    cr_assert_eq(r.status, 413);
    free_reply(&r);
    snprintf(request, sizeof request,
             "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    r = http_raw(port, request);
    cr_assert_eq(r.status, 200, "an empty body is no body");
    free_reply(&r);

    km_http_stats stats;
    km_http_get_stats(http, &stats);
    cr_assert_eq(stats.not_found, 3);
    cr_assert_eq(stats.bad_method, 5);
    cr_assert_eq(stats.body_refused, 2);
    cr_assert_eq(stats.callback_failed, 0);
    cr_assert_eq(stats.requests, 4 + 3 + 5 + 3);
    stop_server(http, &s);
}

Test(http, readyz_follows_the_callback, .timeout = 30)
{
    service s;
    km_http *http = start_server(&s);
    uint16_t port = km_http_port(http);
    http_reply r = http_get(port, "GET", "/readyz");
    cr_assert_eq(r.status, 503);
    cr_assert_str_eq(r.body, "not ready: 1/4 workers LIVE, need 75%\n");
    free_reply(&r);
    atomic_store(&s.ready, 1);
    r = http_get(port, "GET", "/readyz");
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "ready: 3/4 workers LIVE, need 75%\n");
    free_reply(&r);
    atomic_store(&s.ready, 0);
    r = http_get(port, "GET", "/readyz");
    cr_assert_eq(r.status, 503, "readiness can be lost again");
    free_reply(&r);
    /* Liveness never consults the service. */
    int calls = atomic_load(&s.calls);
    r = http_get(port, "GET", "/healthz");
    cr_assert_eq(r.status, 200);
    cr_assert_eq(atomic_load(&s.calls), calls);
    free_reply(&r);
    stop_server(http, &s);
}

Test(http, without_callbacks_and_registry, .timeout = 30)
{
    km_http *http = NULL;
    char error[256];
    cr_assert_eq(km_http_start(NULL, &http, error, sizeof error), KM_OK, "%s", error);
    uint16_t port = km_http_port(http);
    http_reply r = http_get(port, "GET", "/readyz");
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "ready: no readiness check configured\n");
    free_reply(&r);
    r = http_get(port, "GET", "/status");
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "{}");
    free_reply(&r);
    r = http_get(port, "GET", "/metrics");
    cr_assert_eq(r.status, 200);
    cr_assert_eq(r.body_length, 0);
    free_reply(&r);
    km_http_stop(http);
    km_http_stop(NULL);
}

Test(http, failing_callbacks_give_500, .timeout = 30)
{
    service s;
    km_http *http = start_server(&s);
    uint16_t port = km_http_port(http);
    atomic_store(&s.fail_status, 1);
    atomic_store(&s.fail_metrics, 1);
    http_reply r = http_get(port, "GET", "/status");
    cr_assert_eq(r.status, 500);
    cr_assert_str_eq(r.body, "KM_ERR_INTERNAL: status callback failed: index is being rebuilt\n");
    free_reply(&r);
    r = http_get(port, "GET", "/metrics");
    cr_assert_eq(r.status, 500);
    cr_assert_str_eq(r.body, "KM_ERR_TIMEOUT: metrics callback failed: feed lock timed out\n");
    free_reply(&r);
    atomic_store(&s.fail_metrics, 0);
    r = http_get(port, "GET", "/metrics");
    cr_assert_eq(r.status, 200, "the server keeps serving after a failure");
    free_reply(&r);
    km_http_stats stats;
    km_http_get_stats(http, &stats);
    cr_assert_eq(stats.callback_failed, 2);
    stop_server(http, &s);
}

Test(http, bind_addresses_are_checked, .timeout = 30)
{
    const char *refused[] = {"0.0.0.0", "192.168.1.10", "10.0.0.1", "::", "2001:db8::1",
                             "::ffff:10.0.0.1"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        km_http_config cfg;
        km_http_config_init(&cfg);
        cfg.bind_address = refused[i];
        km_http *http = (km_http *)1;
        char error[256];
        cr_assert_eq(km_http_start(&cfg, &http, error, sizeof error), KM_ERR_INVALID_ARGUMENT,
                     "%s", refused[i]);
        cr_assert_null(http);
        cr_assert_neq(strstr(error, "not a loopback address"), NULL, "%s", error);
        cr_assert_neq(strstr(error, "KM_ERR_INVALID_ARGUMENT"), NULL, "%s", error);
    }
    const char *malformed[] = {"example.com", "127.0.0.256", "", "1.2.3"};
    for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++) {
        km_http_config cfg;
        km_http_config_init(&cfg);
        cfg.bind_address = malformed[i];
        km_http *http;
        char error[256];
        cr_assert_eq(km_http_start(&cfg, &http, error, sizeof error), KM_ERR_INVALID_ARGUMENT,
                     "%s", malformed[i]);
        cr_assert_neq(strstr(error, "not a numeric"), NULL, "%s", error);
    }
    km_http_config cfg;
    km_http_config_init(&cfg);
    cfg.max_connections = 0;
    km_http *http;
    char error[256];
    cr_assert_eq(km_http_start(&cfg, &http, error, sizeof error), KM_ERR_INVALID_ARGUMENT);
    cr_assert_neq(strstr(error, "max_connections"), NULL, "%s", error);
    cr_assert_eq(km_http_start(&cfg, NULL, error, sizeof error), KM_ERR_NULL_POINTER);

    /* Other loopback forms are served. */
    const char *loopbacks[] = {"localhost", "127.0.0.2", "::1"};
    for (size_t i = 0; i < sizeof loopbacks / sizeof loopbacks[0]; i++) {
        km_http_config_init(&cfg);
        cfg.bind_address = loopbacks[i];
        int rc = km_http_start(&cfg, &http, error, sizeof error);
        if (rc == KM_ERR_IO && strchr(loopbacks[i], ':')) {
            cr_log_warn("::1 not bindable here (%s); IPv6 loopback not checked", error);
            continue;
        }
        cr_assert_eq(rc, KM_OK, "%s: %s", loopbacks[i], error);
        cr_assert_neq(km_http_port(http), 0);
        km_http_stop(http);
    }
}

Test(http, port_in_use_is_an_io_error, .timeout = 30)
{
    service s;
    km_http *first = start_server(&s);
    km_http_config cfg;
    km_http_config_init(&cfg);
    cfg.port = km_http_port(first);
    km_text log;
    km_text_init(&log, 0);
    cfg.log = collect_log;
    cfg.log_user = &log;
    km_http *second = (km_http *)1;
    char error[512];
    cr_assert_eq(km_http_start(&cfg, &second, error, sizeof error), KM_ERR_IO);
    cr_assert_null(second);
    char expected[128];
    snprintf(expected, sizeof expected, "KM_ERR_IO: cannot serve HTTP on 127.0.0.1 port %u: ",
             (unsigned)cfg.port);
    cr_assert_eq(strncmp(error, expected, strlen(expected)), 0, "%s", error);
    cr_assert_neq(strstr(error, "in use"), NULL, "libmicrohttpd's reason is kept: %s", error);
    /* libmicrohttpd's line states its level: the fixed KM_LOG_WARNING, whatever its words. */
    cr_assert_eq(strncmp(km_text_cstr(&log), KM_LOG_WARNING "http: ", strlen(KM_LOG_WARNING "http: ")),
                 0, "log: %s", km_text_cstr(&log));
    cr_assert_neq(strstr(km_text_cstr(&log), "in use"), NULL, "log: %s", km_text_cstr(&log));
    km_text_free(&log);
    /* The first one is untouched. */
    http_reply r = http_get(km_http_port(first), "GET", "/healthz");
    cr_assert_eq(r.status, 200);
    free_reply(&r);
    stop_server(first, &s);
}

typedef struct scraper_args {
    uint16_t port;
    atomic_int *failures;
} scraper_args;

static void *scraper(void *p)
{
    scraper_args *a = p;
    const char *paths[] = {"/metrics", "/status", "/readyz", "/healthz"};
    for (int i = 0; i < 40; i++) {
        http_reply r = http_get(a->port, "GET", paths[i % 4]);
        if (r.status != 200 && !(r.status == 503 && i % 4 == 2))
            atomic_fetch_add(a->failures, 1);
        if (i % 4 == 0 && !strstr(r.body, "kvmatch_decisions_total "))
            atomic_fetch_add(a->failures, 1);
        free_reply(&r);
    }
    return NULL;
}

static void *bumper(void *p)
{
    service *s = p;
    for (int i = 0; i < 200000; i++)
        km_counter_increment(s->decisions);
    return NULL;
}

Test(http, concurrent_scrapes_while_counting, .timeout = 60)
{
    service s;
    km_http *http = start_server(&s);
    atomic_int failures;
    atomic_init(&failures, 0);
    pthread_t scrapers[4], counter_thread;
    scraper_args args = {km_http_port(http), &failures};
    cr_assert_eq(pthread_create(&counter_thread, NULL, bumper, &s), 0);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(pthread_create(&scrapers[i], NULL, scraper, &args), 0);
    for (int i = 0; i < 4; i++)
        pthread_join(scrapers[i], NULL);
    pthread_join(counter_thread, NULL);
    cr_assert_eq(atomic_load(&failures), 0);
    http_reply r = http_get(km_http_port(http), "GET", "/metrics");
    cr_assert_neq(strstr(r.body, "kvmatch_decisions_total 200000\n"), NULL, "%s", r.body);
    free_reply(&r);
    km_http_stats stats;
    km_http_get_stats(http, &stats);
    cr_assert_eq(stats.requests, 4 * 40 + 1);
    stop_server(http, &s);
}

/* Stop closes every connection at once, whatever state it is in: with an idle timeout of 60 s, a
 * stop that waited for the clients to time out would run past the test's timeout. The 10 s bound
 * is far above a prompt stop (milliseconds) and far below that idle timeout. */
Test(http, stop_with_clients_connected_is_bounded, .timeout = 30)
{
    service s;
    km_http *http = start_server_idle_timeout(&s, 60);
    uint16_t port = km_http_port(http);
    /* One client mid-request (headers unfinished), one idle keep-alive connection after a reply,
     * one connected and silent. */
    int partial = connect_loopback(port);
    const char *half = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    send_all(partial, half, strlen(half));
    int keepalive = connect_loopback(port);
    const char *full = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(keepalive, full, strlen(full));
    char buf[512];
    ssize_t n = recv(keepalive, buf, sizeof buf - 1, 0);
    cr_assert(n > 0);
    buf[n] = '\0';
    cr_assert_eq(strncmp(buf, "HTTP/1.1 200", 12), 0, "%s", buf);
    int silent = connect_loopback(port);
    usleep(100 * 1000); /* let the server accept all three */

    double start = now_seconds();
    km_http_stop(http);
    double took = now_seconds() - start;
    cr_assert(took < 10.0, "km_http_stop took %.3f s with clients connected", took);

    /* Every client sees its connection closed (EOF or reset), not a hang. */
    int clients[] = {partial, keepalive, silent};
    for (int i = 0; i < 3; i++) {
        struct pollfd p = {clients[i], POLLIN, 0};
        cr_assert_eq(poll(&p, 1, 10000), 1, "client %d not closed", i);
        char c;
        ssize_t got = recv(clients[i], &c, 1, 0);
        cr_assert(got <= 0, "client %d got data after stop", i);
        close(clients[i]);
    }
    /* Nothing listens any more. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_neq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    close(fd);
    km_metrics_destroy(s.metrics);
    km_text_free(&s.log);
}

/* An independent reading of the exposition format: a strict line grammar, family headers before
 * their samples, each family's samples together, histograms with ascending le, cumulative counts,
 * +Inf == _count. */
static const char *python_checker =
    "import re, sys, math\n"
    "text = open(sys.argv[1]).read()\n"
    "assert text.endswith('\\n')\n"
    "name = r'[a-zA-Z_:][a-zA-Z0-9_:]*'\n"
    "lval = r'\"(?:[^\"\\\\\\n]|\\\\[\\\\\"n])*\"'\n"
    "labels = r'\\{(?:[a-zA-Z_][a-zA-Z0-9_]*=' + lval + r'(?:,[a-zA-Z_][a-zA-Z0-9_]*=' + lval + r')*)?\\}'\n"
    "sample = re.compile(r'^(' + name + r')(' + labels + r')? (\\S+)$')\n"
    "types = {}; order = []; hist = {}\n"
    "for line in text.splitlines():\n"
    "    if line.startswith('# HELP '):\n"
    "        continue\n"
    "    if line.startswith('# TYPE '):\n"
    "        _, _, fam, kind = line.split(' ')\n"
    "        assert fam not in types, 'family twice: ' + fam\n"
    "        assert kind in ('counter', 'gauge', 'histogram', 'untyped'), line\n"
    "        types[fam] = kind; order.append(fam); continue\n"
    "    m = sample.match(line)\n"
    "    assert m, 'bad line: ' + line\n"
    "    n, lab, v = m.group(1), m.group(2) or '', m.group(3)\n"
    "    float(v.replace('+Inf', 'inf').replace('-Inf', '-inf').replace('NaN', 'nan'))\n"
    "    fam = order[-1]\n"
    "    if types[fam] == 'histogram':\n"
    "        base = re.sub(r',?le=\"[^\"]*\"', '', lab).replace('{}', '')\n"
    "        h = hist.setdefault((fam, base), {'b': [], 'count': None})\n"
    "        if n == fam + '_bucket':\n"
    "            le = re.search(r'le=\"([^\"]*)\"', lab).group(1)\n"
    "            h['b'].append((float(le.replace('+Inf', 'inf')), int(v)))\n"
    "        elif n == fam + '_count': h['count'] = int(v)\n"
    "        else: assert n == fam + '_sum', line\n"
    "    else:\n"
    "        assert n == fam, 'sample %s outside its family %s' % (n, fam)\n"
    "for (fam, base), h in hist.items():\n"
    "    b = h['b']\n"
    "    assert b and math.isinf(b[-1][0]), fam\n"
    "    assert all(b[i][0] < b[i+1][0] and b[i][1] <= b[i+1][1] for i in range(len(b)-1)), fam\n"
    "    assert b[-1][1] == h['count'], fam\n"
    "print('ok', len(types), 'families', len(hist), 'histogram series')\n";

Test(http, metrics_pass_an_independent_parser, .timeout = 30)
{
    if (system("python3 -c 'import re' >/dev/null 2>&1") != 0)
        cr_skip_test("python3 not available: independent /metrics parse skipped");
    service s;
    km_http *http = start_server(&s);
    size_t nb;
    const double *bounds = km_metrics_latency_buckets_seconds(&nb);
    km_metric_label pools[][1] = {{{"pool", "chat"}}, {{"pool", "code \"v2\"\\x\ny"}}};
    for (int p = 0; p < 2; p++) {
        km_histogram *h;
        cr_assert_eq(km_metrics_add_histogram(s.metrics, "kvmatch_rtt_seconds", "RTT.\nsecond",
                                              pools[p], 1, bounds, nb, &h), KM_OK);
        for (int i = 0; i < 1000; i++)
            km_histogram_observe(h, 1e-6 * (double)(i * (p + 1)));
    }
    km_gauge *g;
    cr_assert_eq(km_metrics_add_gauge(s.metrics, "kvmatch_gauge", "", NULL, 0, &g), KM_OK);
    km_gauge_set(g, NAN);
    http_reply r = http_get(km_http_port(http), "GET", "/metrics");
    cr_assert_eq(r.status, 200);
    char dir[] = "/tmp/km_http_test_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char script[128], body[128], command[512];
    snprintf(script, sizeof script, "%s/check.py", dir);
    snprintf(body, sizeof body, "%s/metrics.txt", dir);
    FILE *f = fopen(script, "w");
    fputs(python_checker, f);
    fclose(f);
    f = fopen(body, "w");
    fwrite(r.body, 1, r.body_length, f);
    fclose(f);
    snprintf(command, sizeof command, "python3 %s %s", script, body);
    char output[4096];
    int status = km_test_run_capture(command, output, sizeof output);
    unlink(script);
    unlink(body);
    rmdir(dir);
    cr_assert_eq(status, 0, "python parser rejected /metrics: %s\n---\n%s", output, r.body);
    cr_assert_neq(strstr(output, "ok 4 families 2 histogram series"), NULL, "%s", output);
    free_reply(&r);
    stop_server(http, &s);
}

/* A client that never finishes its headers stays connected for the whole test (idle timeout 60 s,
 * past the test's timeout): a server that served others only once it had given up on that client
 * would never answer the probes in time. The 10 s bound on 20 probes is far above their time
 * (milliseconds) and far below the idle timeout. */
Test(http, slow_and_oversize_clients_do_not_block_others, .timeout = 30)
{
    service s;
    km_http *http = start_server_idle_timeout(&s, 60);
    uint16_t port = km_http_port(http);
    /* A client that trickles its headers and never finishes. */
    int slow = connect_loopback(port);
    send_all(slow, "GET /metr", 9);
    /* A request line far above libmicrohttpd's per-connection memory: refused or cut off. */
    size_t big_length = 200000;
    char *big = malloc(big_length + 64);
    memcpy(big, "GET /", 5);
    memset(big + 5, 'a', big_length);
    strcpy(big + 5 + big_length, " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    int oversize = connect_loopback(port);
    size_t sent = 0, total = strlen(big);
    while (sent < total) { /* the server may close before reading it all */
        ssize_t n = send(oversize, big + sent, total - sent, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        sent += (size_t)n;
    }
    char reply[256] = {0};
    ssize_t got = recv(oversize, reply, sizeof reply - 1, 0);
    if (got > 0) {
        int status = 0;
        sscanf(reply, "HTTP/1.%*d %d", &status);
        cr_assert(status == 414 || status == 431 || status == 400, "oversize request got %d", status);
    }
    close(oversize);
    free(big);
    /* Everyone else is served at once. */
    double start = now_seconds();
    for (int i = 0; i < 20; i++) {
        http_reply r = http_get(port, "GET", "/healthz");
        cr_assert_eq(r.status, 200);
        free_reply(&r);
    }
    cr_assert(now_seconds() - start < 10.0, "20 probes took %.3f s", now_seconds() - start);
    close(slow);
    km_http_stop(http);
    cr_assert_neq(strstr(km_text_cstr(&s.log), "414"), NULL, "log: %s", km_text_cstr(&s.log));
    km_metrics_destroy(s.metrics);
    km_text_free(&s.log);
}

Test(http, connection_limit_refuses_extra_clients, .timeout = 30)
{
    km_http_config cfg;
    km_http_config_init(&cfg);
    cfg.max_connections = 2;
    cfg.log = collect_log;
    km_text log;
    km_text_init(&log, 0);
    cfg.log_user = &log;
    km_http *http;
    char error[256];
    cr_assert_eq(km_http_start(&cfg, &http, error, sizeof error), KM_OK, "%s", error);
    uint16_t port = km_http_port(http);
    /* Two clients mid-request hold both slots (an idle keep-alive connection would not:
     * libmicrohttpd closes those to make room). */
    int held[2];
    for (int i = 0; i < 2; i++) {
        held[i] = connect_loopback(port);
        send_all(held[i], "GET /healthz HTTP/1.1\r\nHost: x\r\n", 33);
    }
    usleep(100 * 1000);
    /* A third is not served while both slots are held: libmicrohttpd either accepts and closes
     * it, or (epoll) stops accepting, leaving it in the kernel's backlog. */
    int extra = connect_loopback(port);
    send(extra, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 35, MSG_NOSIGNAL);
    struct pollfd p = {extra, POLLIN, 0};
    if (poll(&p, 1, 500) == 1) {
        char c;
        cr_assert(recv(extra, &c, 1, 0) <= 0, "a connection above the limit was served");
    }
    close(extra);
    /* Freeing a slot lets a new client in. */
    close(held[0]);
    int served = 0;
    for (int attempt = 0; attempt < 50 && !served; attempt++) {
        usleep(20 * 1000);
        int fd = connect_loopback(port);
        send(fd, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 54, MSG_NOSIGNAL);
        char buf[64] = {0};
        served = recv(fd, buf, sizeof buf - 1, 0) > 0 && strncmp(buf, "HTTP/1.1 200", 12) == 0;
        close(fd);
    }
    cr_assert(served, "no client served after a slot was freed");
    close(held[1]);
    km_http_stop(http);
    km_text_free(&log);
}

/* One reply read from a connection that stays open: its headers, then Content-Length bytes of
 * body (none for HEAD). Returns the status; *closing: the reply says Connection: close. */
static int read_reply_on(int fd, bool head, bool *closing, char *body, size_t body_size)
{
    char data[16384];
    size_t length = 0;
    char *end = NULL;
    while (!end) {
        cr_assert_lt(length, sizeof data - 1, "reply headers too long");
        ssize_t n = recv(fd, data + length, 1, 0); /* byte by byte: never past this reply */
        cr_assert(n > 0, "the connection ended before a whole reply (%s)",
                  n < 0 ? strerror(errno) : "EOF");
        length += (size_t)n;
        data[length] = '\0';
        end = strstr(data, "\r\n\r\n");
    }
    http_reply r = {0};
    sscanf(data, "HTTP/1.%*d %d", &r.status);
    snprintf(r.headers, sizeof r.headers, "%.*s", (int)(end - data), data);
    char value[64];
    *closing = strcasecmp(header_value(&r, "Connection", value, sizeof value), "close") == 0;
    size_t want = head ? 0 : (size_t)strtoull(header_value(&r, "Content-Length", value,
                                                           sizeof value), NULL, 10);
    cr_assert_lt(want, body_size);
    size_t got = 0;
    while (got < want) {
        ssize_t n = recv(fd, body + got, want - got, 0);
        cr_assert(n > 0, "the connection ended inside a reply body");
        got += (size_t)n;
    }
    body[got] = '\0';
    return r.status;
}

/* HTTP/1.1 connections persist: a scraper or a probe sends request after request on one
 * connection, one after the other or several in one write, and each gets its reply; only a
 * request announcing a body (refused before it is read) ends its connection. */
Test(http, a_connection_serves_request_after_request, .timeout = 30)
{
    service s;
    km_http *http = start_server(&s);
    uint16_t port = km_http_port(http);
    char body[8192];
    bool closing = true;

    int fd = connect_loopback(port);
    const char *paths[] = {"/healthz", "/metrics", "/status", "/readyz", "/nope"};
    const int statuses[] = {200, 200, 200, 503, 404};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char request[128];
        snprintf(request, sizeof request, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", paths[i]);
        send_all(fd, request, strlen(request));
        cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), statuses[i], "%s",
                     paths[i]);
        cr_assert_not(closing, "GET %s ended its connection", paths[i]);
    }
    /* HEAD and a refused method keep it open too. */
    send_all(fd, "HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 35);
    cr_assert_eq(read_reply_on(fd, true, &closing, body, sizeof body), 200);
    cr_assert_not(closing);
    send_all(fd, "DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 37);
    cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), 405);
    cr_assert_not(closing);
    /* Three requests in one write: three replies, in order. */
    const char *pipelined = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                            "GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
                            "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(fd, pipelined, strlen(pipelined));
    cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), 200);
    cr_assert_str_eq(body, "ok\n");
    cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), 200);
    cr_assert_eq(body[0], '{', "%s", body);
    cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), 200);
    cr_assert_str_eq(body, "ok\n");
    cr_assert_not(closing);
    /* A body is refused unread, and that connection ends after the 413. */
    send_all(fd, "GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", 55);
    cr_assert_eq(read_reply_on(fd, false, &closing, body, sizeof body), 413);
    cr_assert(closing, "a connection whose body was not read must end");
    char c;
    cr_assert_leq(recv(fd, &c, 1, 0), 0, "data after the 413");
    close(fd);

    km_http_stats stats;
    km_http_get_stats(http, &stats);
    cr_assert_eq(stats.requests, 11);
    cr_assert_eq(stats.not_found, 1);
    cr_assert_eq(stats.bad_method, 1);
    cr_assert_eq(stats.body_refused, 1);
    stop_server(http, &s);
}
