/* SPDX-License-Identifier: Apache-2.0 */
/* Metrics registry and Prometheus text rendering (include/kvmatch/metrics.h).
 *
 * Layout: the registry is a list of families; a family owns its series, each allocated once and
 * never moved or freed before km_metrics_destroy, so the handles given out stay valid and updates
 * need no lock. Values are C11 atomics updated with relaxed order (each value is independent; no
 * reader infers anything from the order of two updates). Doubles live in _Atomic uint64_t as their
 * bit pattern; adding to one is a compare-and-swap loop. A series' label set is rendered once, at
 * registration, into the text that goes between the braces; that text also identifies the series
 * within its family (label names are fixed per family, so equal text means equal label values). */
#include "kvmatch/metrics.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Prometheus text helpers ------------------------------------------------------------------- */

static const char *const metric_type_names[] = {
#define KM_METRIC_TYPE_NAME(value, name) [value] = name,
    KM_METRIC_TYPE_LIST(KM_METRIC_TYPE_NAME)
#undef KM_METRIC_TYPE_NAME
};

const char *km_metric_type_name(km_metric_type type)
{
    size_t n = sizeof metric_type_names / sizeof metric_type_names[0];
    return (unsigned)type < n ? metric_type_names[type] : "untyped";
}

static bool is_alpha_(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

int km_prom_valid_metric_name(const char *name)
{
    if (!name || !name[0] || strlen(name) > KM_METRICS_NAME_MAX)
        return 0;
    if (!is_alpha_(name[0]) && name[0] != ':')
        return 0;
    for (const char *p = name + 1; *p; p++)
        if (!is_alpha_(*p) && !is_digit(*p) && *p != ':')
            return 0;
    return 1;
}

int km_prom_valid_label_name(const char *name)
{
    if (!name || !name[0] || strlen(name) > KM_METRICS_NAME_MAX)
        return 0;
    if (!is_alpha_(name[0]) || (name[0] == '_' && name[1] == '_'))
        return 0;
    for (const char *p = name + 1; *p; p++)
        if (!is_alpha_(*p) && !is_digit(*p))
            return 0;
    return 1;
}

/* Escape backslash and newline (help text), and the double quote too when `quote`. */
static int escape_into(km_text *out, const char *s, bool quote)
{
    const char *run = s;
    for (const char *p = s; *p; p++) {
        const char *replacement = NULL;
        if (*p == '\\')
            replacement = "\\\\";
        else if (*p == '\n')
            replacement = "\\n";
        else if (quote && *p == '"')
            replacement = "\\\"";
        if (!replacement)
            continue;
        km_text_append(out, run, (size_t)(p - run));
        km_text_append_cstr(out, replacement);
        run = p + 1;
    }
    return km_text_append_cstr(out, run);
}

int km_prom_escape_label_value(km_text *out, const char *value)
{
    if (!out || !value)
        return KM_ERR_NULL_POINTER;
    return escape_into(out, value, true);
}

/* Shortest decimal text that reads back as exactly `value` (integers below 1e15 in plain digits);
 * Prometheus' words for the rest. */
static void format_double(char *buf, size_t size, double value)
{
    if (isnan(value)) {
        snprintf(buf, size, "NaN");
        return;
    }
    if (isinf(value)) {
        snprintf(buf, size, value > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (value == floor(value) && fabs(value) < 1e15) { /* integers as integers, not 8e+05 */
        snprintf(buf, size, "%.0f", value);
        return;
    }
    for (int precision = 1; precision <= 17; precision++) {
        snprintf(buf, size, "%.*g", precision, value);
        if (strtod(buf, NULL) == value)
            return;
    }
}

int km_prom_write_family(km_text *out, const char *name, const char *help, km_metric_type type)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    if (!km_prom_valid_metric_name(name))
        return KM_ERR_INVALID_ARGUMENT;
    km_text_printf(out, "# HELP %s ", name);
    escape_into(out, help ? help : "", false);
    return km_text_printf(out, "\n# TYPE %s %s\n", name, km_metric_type_name(type));
}

/* Validate labels, then write "{a=\"x\",b=\"y\"" without the closing brace (nothing when none and
 * !always_open). Returns KM_ERR_INVALID_ARGUMENT / KM_ERR_NULL_POINTER before writing anything. */
static int check_labels(const km_metric_label *labels, size_t label_count)
{
    if (label_count && !labels)
        return KM_ERR_NULL_POINTER;
    for (size_t i = 0; i < label_count; i++) {
        if (!labels[i].name || !labels[i].value)
            return KM_ERR_NULL_POINTER;
        if (!km_prom_valid_label_name(labels[i].name))
            return KM_ERR_INVALID_ARGUMENT;
    }
    return KM_OK;
}

static void write_label_list(km_text *out, const km_metric_label *labels, size_t label_count)
{
    for (size_t i = 0; i < label_count; i++) {
        km_text_printf(out, "%s%s=\"", i ? "," : "", labels[i].name);
        escape_into(out, labels[i].value, true);
        km_text_append_cstr(out, "\"");
    }
}

static int write_sample_text(km_text *out, const char *name, const km_metric_label *labels,
                             size_t label_count, const char *value_text)
{
    if (!out || !name)
        return KM_ERR_NULL_POINTER;
    if (!km_prom_valid_metric_name(name))
        return KM_ERR_INVALID_ARGUMENT;
    int rc = check_labels(labels, label_count);
    if (rc != KM_OK)
        return rc;
    km_text_append_cstr(out, name);
    if (label_count) {
        km_text_append_cstr(out, "{");
        write_label_list(out, labels, label_count);
        km_text_append_cstr(out, "}");
    }
    return km_text_printf(out, " %s\n", value_text);
}

int km_prom_write_sample(km_text *out, const char *name, const km_metric_label *labels,
                         size_t label_count, double value)
{
    char value_text[40];
    format_double(value_text, sizeof value_text, value);
    return write_sample_text(out, name, labels, label_count, value_text);
}

int km_prom_write_sample_u64(km_text *out, const char *name, const km_metric_label *labels,
                             size_t label_count, uint64_t value)
{
    char value_text[24];
    snprintf(value_text, sizeof value_text, "%" PRIu64, value);
    return write_sample_text(out, name, labels, label_count, value_text);
}

/* ---- standard buckets -------------------------------------------------------------------------- */

static const double batch_size_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096};
static const double latency_buckets_seconds[] = {
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
    5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
};

const double *km_metrics_batch_size_buckets(size_t *count)
{
    if (count)
        *count = sizeof batch_size_buckets / sizeof batch_size_buckets[0];
    return batch_size_buckets;
}

const double *km_metrics_latency_buckets_seconds(size_t *count)
{
    if (count)
        *count = sizeof latency_buckets_seconds / sizeof latency_buckets_seconds[0];
    return latency_buckets_seconds;
}

/* ---- series and values ------------------------------------------------------------------------- */

typedef struct series_header {
    struct series_header *next; /* next series of the family, registration order */
    char *labels;               /* rendered label list without braces: a="x",b="y" ("" when none) */
} series_header;

struct km_counter {
    series_header header;
    _Atomic uint64_t value;
};

struct km_gauge {
    series_header header;
    _Atomic uint64_t bits; /* the double's bit pattern */
};

struct km_histogram {
    series_header header;
    const double *bounds; /* the family's; bound_count finite bounds, ascending */
    size_t bound_count;
    _Atomic uint64_t sum_bits;
    _Atomic uint64_t buckets[]; /* bound_count + 1 non-cumulative counts; the last is +Inf */
};

static uint64_t double_bits(double value)
{
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static double bits_double(uint64_t bits)
{
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void atomic_add_double(_Atomic uint64_t *target, double delta)
{
    uint64_t old = atomic_load_explicit(target, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(target, &old, double_bits(bits_double(old) + delta),
                                                  memory_order_relaxed, memory_order_relaxed))
        ;
}

void km_counter_add(km_counter *counter, uint64_t amount)
{
    if (counter)
        atomic_fetch_add_explicit(&counter->value, amount, memory_order_relaxed);
}

uint64_t km_counter_value(const km_counter *counter)
{
    return counter ? atomic_load_explicit(&((km_counter *)counter)->value, memory_order_relaxed) : 0;
}

void km_gauge_set(km_gauge *gauge, double value)
{
    if (gauge)
        atomic_store_explicit(&gauge->bits, double_bits(value), memory_order_relaxed);
}

void km_gauge_add(km_gauge *gauge, double delta)
{
    if (gauge)
        atomic_add_double(&gauge->bits, delta);
}

double km_gauge_value(const km_gauge *gauge)
{
    if (!gauge)
        return 0;
    return bits_double(atomic_load_explicit(&((km_gauge *)gauge)->bits, memory_order_relaxed));
}

/* Index of the first bound >= value; bound_count (the +Inf bucket) when above all. */
static size_t bucket_index(const double *bounds, size_t bound_count, double value)
{
    size_t low = 0, high = bound_count;
    while (low < high) {
        size_t mid = low + (high - low) / 2;
        if (bounds[mid] >= value)
            high = mid;
        else
            low = mid + 1;
    }
    return low;
}

void km_histogram_observe(km_histogram *histogram, double value)
{
    if (!histogram || isnan(value))
        return;
    size_t i = bucket_index(histogram->bounds, histogram->bound_count, value);
    atomic_fetch_add_explicit(&histogram->buckets[i], 1, memory_order_relaxed);
    atomic_add_double(&histogram->sum_bits, value);
}

/* One read of every bucket into counts[0..bound_count]; returns their total. */
static uint64_t histogram_read(const km_histogram *histogram, uint64_t *counts)
{
    uint64_t total = 0;
    km_histogram *h = (km_histogram *)histogram;
    for (size_t i = 0; i <= h->bound_count; i++) {
        counts[i] = atomic_load_explicit(&h->buckets[i], memory_order_relaxed);
        total += counts[i];
    }
    return total;
}

uint64_t km_histogram_count(const km_histogram *histogram)
{
    if (!histogram)
        return 0;
    uint64_t counts[KM_METRICS_BUCKETS_MAX + 1];
    return histogram_read(histogram, counts);
}

double km_histogram_sum(const km_histogram *histogram)
{
    if (!histogram)
        return 0;
    return bits_double(atomic_load_explicit(&((km_histogram *)histogram)->sum_bits,
                                            memory_order_relaxed));
}

double km_histogram_quantile(const km_histogram *histogram, double q)
{
    if (!histogram || !(q >= 0 && q <= 1))
        return NAN;
    uint64_t counts[KM_METRICS_BUCKETS_MAX + 1];
    uint64_t total = histogram_read(histogram, counts);
    if (total == 0)
        return NAN;
    double rank = q * (double)total;
    double wanted = ceil(rank);
    if (wanted < 1)
        wanted = 1;
    const double *bounds = histogram->bounds;
    size_t n = histogram->bound_count;
    uint64_t before = 0;
    size_t i = 0;
    for (; i <= n; i++) {
        if ((double)(before + counts[i]) >= wanted)
            break;
        before += counts[i];
    }
    if (i >= n) /* the +Inf bucket (or rounding past the end): nothing better than the top bound */
        return bounds[n - 1];
    double upper = bounds[i];
    double lower;
    if (i == 0) {
        if (upper <= 0)
            return upper;
        lower = 0;
    } else {
        lower = bounds[i - 1];
    }
    double fraction = (rank - (double)before) / (double)counts[i];
    if (fraction < 0)
        fraction = 0;
    if (fraction > 1)
        fraction = 1;
    return lower + (upper - lower) * fraction;
}

/* ---- registry ---------------------------------------------------------------------------------- */

typedef struct family {
    struct family *next;
    char *name;
    char *help;
    km_metric_type type;
    char **label_names;
    size_t label_count;
    double *bounds; /* histograms */
    size_t bound_count;
    series_header *first, *last;
} family;

struct km_metrics {
    pthread_mutex_t lock;
    family *first, *last;
    char last_error[256];
};

#if defined(__GNUC__)
static int registry_fail(km_metrics *registry, int status, const char *format, ...)
    __attribute__((format(printf, 3, 4)));
#endif

static int registry_fail(km_metrics *registry, int status, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    int n = snprintf(registry->last_error, sizeof registry->last_error, "%s: ",
                     km_error_name(status));
    if (n > 0 && (size_t)n < sizeof registry->last_error)
        vsnprintf(registry->last_error + n, sizeof registry->last_error - (size_t)n, format, ap);
    va_end(ap);
    return status;
}

int km_metrics_create(km_metrics **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_metrics *registry = calloc(1, sizeof *registry);
    if (!registry)
        return KM_ERR_OUT_OF_MEMORY;
    if (pthread_mutex_init(&registry->lock, NULL) != 0) {
        free(registry);
        return KM_ERR_OUT_OF_MEMORY;
    }
    *out = registry;
    return KM_OK;
}

static void family_free(family *f)
{
    if (!f)
        return;
    series_header *s = f->first;
    while (s) {
        series_header *next = s->next;
        free(s->labels);
        free(s);
        s = next;
    }
    for (size_t i = 0; i < f->label_count; i++)
        free(f->label_names[i]);
    free(f->label_names);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
}

void km_metrics_destroy(km_metrics *registry)
{
    if (!registry)
        return;
    family *f = registry->first;
    while (f) {
        family *next = f->next;
        family_free(f);
        f = next;
    }
    pthread_mutex_destroy(&registry->lock);
    free(registry);
}

const char *km_metrics_last_error(const km_metrics *registry)
{
    return registry ? registry->last_error : "";
}

/* Checks of one registration that need no lock. */
static int check_registration(km_metrics *registry, const char *name, const char *help,
                              const km_metric_label *labels, size_t label_count,
                              const double *bounds, size_t bound_count, km_metric_type type)
{
    if (!km_prom_valid_metric_name(name)) {
        if (strlen(name) > KM_METRICS_NAME_MAX)
            return registry_fail(registry, KM_ERR_TOO_LARGE, "metric name longer than %u bytes",
                                 KM_METRICS_NAME_MAX);
        return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                             "metric name \"%.80s\" is not [a-zA-Z_:][a-zA-Z0-9_:]*", name);
    }
    if (help && strlen(help) > KM_METRICS_HELP_MAX)
        return registry_fail(registry, KM_ERR_TOO_LARGE, "%s: help text longer than %u bytes",
                             name, KM_METRICS_HELP_MAX);
    if (label_count > KM_METRICS_LABELS_MAX)
        return registry_fail(registry, KM_ERR_TOO_LARGE, "%s: %zu labels, at most %u", name,
                             label_count, KM_METRICS_LABELS_MAX);
    if (label_count && !labels)
        return registry_fail(registry, KM_ERR_NULL_POINTER, "%s: labels is NULL", name);
    for (size_t i = 0; i < label_count; i++) {
        const char *label = labels[i].name;
        if (!label || !labels[i].value)
            return registry_fail(registry, KM_ERR_NULL_POINTER, "%s: label %zu has a NULL %s",
                                 name, i, label ? "value" : "name");
        if (strlen(label) > KM_METRICS_NAME_MAX)
            return registry_fail(registry, KM_ERR_TOO_LARGE, "%s: label name longer than %u bytes",
                                 name, KM_METRICS_NAME_MAX);
        if (!km_prom_valid_label_name(label))
            return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                 "%s: label name \"%.80s\" is not [a-zA-Z_][a-zA-Z0-9_]* or starts "
                                 "with \"__\"", name, label);
        if (strcmp(label, "le") == 0)
            return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                 "%s: label name \"le\" is reserved for histogram buckets", name);
        if (strlen(labels[i].value) > KM_METRICS_LABEL_VALUE_MAX)
            return registry_fail(registry, KM_ERR_TOO_LARGE,
                                 "%s: value of label %s longer than %u bytes", name, label,
                                 KM_METRICS_LABEL_VALUE_MAX);
        for (size_t j = 0; j < i; j++)
            if (strcmp(labels[j].name, label) == 0)
                return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                     "%s: label %s given twice", name, label);
    }
    if (type == KM_METRIC_HISTOGRAM) {
        if (!bounds && bound_count)
            return registry_fail(registry, KM_ERR_NULL_POINTER, "%s: bounds is NULL", name);
        if (bound_count == 0)
            return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                 "%s: a histogram needs at least one finite bucket bound", name);
        if (bound_count > KM_METRICS_BUCKETS_MAX)
            return registry_fail(registry, KM_ERR_TOO_LARGE, "%s: %zu bucket bounds, at most %u",
                                 name, bound_count, KM_METRICS_BUCKETS_MAX);
        for (size_t i = 0; i < bound_count; i++) {
            if (!isfinite(bounds[i]))
                return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                     "%s: bucket bound %zu is not finite", name, i);
            if (i && !(bounds[i] > bounds[i - 1]))
                return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                                     "%s: bucket bounds are not strictly ascending at %zu", name, i);
        }
    }
    return KM_OK;
}

static char *copy_string(const char *s)
{
    size_t n = strlen(s) + 1;
    char *copy = malloc(n);
    if (copy)
        memcpy(copy, s, n);
    return copy;
}

static family *family_new(const char *name, const char *help, km_metric_type type,
                          const km_metric_label *labels, size_t label_count, const double *bounds,
                          size_t bound_count)
{
    family *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->type = type;
    f->name = copy_string(name);
    f->help = copy_string(help ? help : "");
    if (!f->name || !f->help)
        goto fail;
    if (label_count) {
        f->label_names = calloc(label_count, sizeof *f->label_names);
        if (!f->label_names)
            goto fail;
        for (; f->label_count < label_count; f->label_count++) {
            f->label_names[f->label_count] = copy_string(labels[f->label_count].name);
            if (!f->label_names[f->label_count])
                goto fail;
        }
    }
    if (type == KM_METRIC_HISTOGRAM) {
        f->bounds = malloc(bound_count * sizeof *f->bounds);
        if (!f->bounds)
            goto fail;
        memcpy(f->bounds, bounds, bound_count * sizeof *f->bounds);
        f->bound_count = bound_count;
    }
    return f;
fail:
    family_free(f);
    return NULL;
}

/* Does family f accept a registration with these attributes? Sets the error when not. */
static int family_matches(km_metrics *registry, const family *f, const char *help,
                          km_metric_type type, const km_metric_label *labels, size_t label_count,
                          const double *bounds, size_t bound_count)
{
    if (f->type != type)
        return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                             "%s is already registered as a %s, not a %s", f->name,
                             km_metric_type_name(f->type), km_metric_type_name(type));
    if (strcmp(f->help, help ? help : "") != 0)
        return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                             "%s is already registered with another help text", f->name);
    bool same_names = f->label_count == label_count;
    for (size_t i = 0; same_names && i < label_count; i++)
        same_names = strcmp(f->label_names[i], labels[i].name) == 0;
    if (!same_names)
        return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                             "%s: every series of a family must have the same label names in the "
                             "same order", f->name);
    if (type == KM_METRIC_HISTOGRAM &&
        (f->bound_count != bound_count || memcmp(f->bounds, bounds, bound_count * sizeof *bounds)))
        return registry_fail(registry, KM_ERR_INVALID_ARGUMENT,
                             "%s is already registered with other bucket bounds", f->name);
    return KM_OK;
}

/* The common path of the three km_metrics_add_*: find or create the family and the series. */
static int add_series(km_metrics *registry, const char *name, const char *help, km_metric_type type,
                      const km_metric_label *labels, size_t label_count, const double *bounds,
                      size_t bound_count, series_header **out)
{
    int rc = check_registration(registry, name, help, labels, label_count, bounds, bound_count, type);
    if (rc != KM_OK)
        return rc;
    km_text label_text;
    km_text_init(&label_text, 0);
    write_label_list(&label_text, labels, label_count);
    if (label_text.status != KM_OK) {
        km_text_free(&label_text);
        return registry_fail(registry, KM_ERR_OUT_OF_MEMORY, "%s: no memory for labels", name);
    }
    const char *key = km_text_cstr(&label_text);

    pthread_mutex_lock(&registry->lock);
    family *f = registry->first;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    bool new_family = false;
    if (f) {
        rc = family_matches(registry, f, help, type, labels, label_count, bounds, bound_count);
        if (rc != KM_OK)
            goto done;
        for (series_header *s = f->first; s; s = s->next) {
            if (strcmp(s->labels, key) == 0) {
                *out = s;
                goto done;
            }
        }
    } else {
        f = family_new(name, help, type, labels, label_count, bounds, bound_count);
        if (!f) {
            rc = registry_fail(registry, KM_ERR_OUT_OF_MEMORY, "%s: no memory for the family", name);
            goto done;
        }
        new_family = true;
    }

    size_t size = type == KM_METRIC_COUNTER ? sizeof(km_counter)
                  : type == KM_METRIC_GAUGE ? sizeof(km_gauge)
                  : sizeof(km_histogram) + (bound_count + 1) * sizeof(_Atomic uint64_t);
    series_header *s = calloc(1, size);
    char *labels_copy = copy_string(key);
    if (!s || !labels_copy) {
        free(s);
        free(labels_copy);
        if (new_family)
            family_free(f);
        rc = registry_fail(registry, KM_ERR_OUT_OF_MEMORY, "%s: no memory for the series", name);
        goto done;
    }
    s->labels = labels_copy;
    if (type == KM_METRIC_COUNTER) {
        atomic_init(&((km_counter *)s)->value, 0);
    } else if (type == KM_METRIC_GAUGE) {
        atomic_init(&((km_gauge *)s)->bits, double_bits(0.0));
    } else {
        km_histogram *h = (km_histogram *)s;
        h->bounds = f->bounds;
        h->bound_count = f->bound_count;
        atomic_init(&h->sum_bits, double_bits(0.0));
        for (size_t i = 0; i <= bound_count; i++)
            atomic_init(&h->buckets[i], 0);
    }
    if (f->last)
        f->last->next = s;
    else
        f->first = s;
    f->last = s;
    if (new_family) {
        if (registry->last)
            registry->last->next = f;
        else
            registry->first = f;
        registry->last = f;
    }
    *out = s;
done:
    pthread_mutex_unlock(&registry->lock);
    km_text_free(&label_text);
    return rc;
}

int km_metrics_add_counter(km_metrics *registry, const char *name, const char *help,
                           const km_metric_label *labels, size_t label_count, km_counter **out)
{
    if (out)
        *out = NULL;
    if (!registry || !name || !out)
        return registry ? registry_fail(registry, KM_ERR_NULL_POINTER, "name or out is NULL")
                        : KM_ERR_NULL_POINTER;
    series_header *s = NULL;
    int rc = add_series(registry, name, help, KM_METRIC_COUNTER, labels, label_count, NULL, 0, &s);
    if (rc == KM_OK)
        *out = (km_counter *)s;
    return rc;
}

int km_metrics_add_gauge(km_metrics *registry, const char *name, const char *help,
                         const km_metric_label *labels, size_t label_count, km_gauge **out)
{
    if (out)
        *out = NULL;
    if (!registry || !name || !out)
        return registry ? registry_fail(registry, KM_ERR_NULL_POINTER, "name or out is NULL")
                        : KM_ERR_NULL_POINTER;
    series_header *s = NULL;
    int rc = add_series(registry, name, help, KM_METRIC_GAUGE, labels, label_count, NULL, 0, &s);
    if (rc == KM_OK)
        *out = (km_gauge *)s;
    return rc;
}

int km_metrics_add_histogram(km_metrics *registry, const char *name, const char *help,
                             const km_metric_label *labels, size_t label_count,
                             const double *bounds, size_t bound_count, km_histogram **out)
{
    if (out)
        *out = NULL;
    if (!registry || !name || !out)
        return registry ? registry_fail(registry, KM_ERR_NULL_POINTER, "name or out is NULL")
                        : KM_ERR_NULL_POINTER;
    series_header *s = NULL;
    int rc = add_series(registry, name, help, KM_METRIC_HISTOGRAM, labels, label_count, bounds,
                        bound_count, &s);
    if (rc == KM_OK)
        *out = (km_histogram *)s;
    return rc;
}

/* ---- rendering --------------------------------------------------------------------------------- */

/* name<suffix>{labels[,extra]} : the sample's name and label part, without the value. */
static void write_series_name(km_text *out, const char *name, const char *suffix,
                              const char *labels, const char *extra)
{
    km_text_append_cstr(out, name);
    km_text_append_cstr(out, suffix);
    bool have_labels = labels[0] != '\0';
    if (!have_labels && !extra)
        return;
    km_text_append_cstr(out, "{");
    km_text_append_cstr(out, labels);
    if (extra) {
        if (have_labels)
            km_text_append_cstr(out, ",");
        km_text_append_cstr(out, extra);
    }
    km_text_append_cstr(out, "}");
}

static void render_histogram(km_text *out, const family *f, const km_histogram *h)
{
    uint64_t counts[KM_METRICS_BUCKETS_MAX + 1];
    uint64_t total = histogram_read(h, counts);
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= h->bound_count; i++) {
        cumulative += counts[i];
        char bound[40], le[56];
        format_double(bound, sizeof bound, i < h->bound_count ? h->bounds[i] : INFINITY);
        snprintf(le, sizeof le, "le=\"%s\"", bound);
        write_series_name(out, f->name, "_bucket", h->header.labels, le);
        km_text_printf(out, " %" PRIu64 "\n", cumulative);
    }
    char sum[40];
    format_double(sum, sizeof sum, km_histogram_sum(h));
    write_series_name(out, f->name, "_sum", h->header.labels, NULL);
    km_text_printf(out, " %s\n", sum);
    write_series_name(out, f->name, "_count", h->header.labels, NULL);
    km_text_printf(out, " %" PRIu64 "\n", total);
}

int km_metrics_render(km_metrics *registry, km_text *out)
{
    if (!registry || !out)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&registry->lock);
    for (const family *f = registry->first; f; f = f->next) {
        km_prom_write_family(out, f->name, f->help, f->type);
        for (const series_header *s = f->first; s; s = s->next) {
            if (f->type == KM_METRIC_HISTOGRAM) {
                render_histogram(out, f, (const km_histogram *)s);
                continue;
            }
            char value[40];
            if (f->type == KM_METRIC_COUNTER)
                snprintf(value, sizeof value, "%" PRIu64, km_counter_value((const km_counter *)s));
            else
                format_double(value, sizeof value, km_gauge_value((const km_gauge *)s));
            write_series_name(out, f->name, "", s->labels, NULL);
            km_text_printf(out, " %s\n", value);
        }
    }
    pthread_mutex_unlock(&registry->lock);
    return out->status;
}

int km_metrics_render_to_buffer(km_metrics *registry, char *buffer, size_t capacity,
                                size_t *needed)
{
    if (!registry || (!buffer && capacity))
        return KM_ERR_NULL_POINTER;
    km_text text;
    km_text_init(&text, 0);
    int rc = km_metrics_render(registry, &text);
    if (rc != KM_OK) {
        km_text_free(&text);
        return rc;
    }
    if (needed)
        *needed = text.length + 1;
    if (capacity) {
        size_t n = text.length < capacity ? text.length : capacity - 1;
        memcpy(buffer, km_text_cstr(&text), n);
        buffer[n] = '\0';
    }
    rc = text.length < capacity ? KM_OK : KM_ERR_TOO_LARGE;
    km_text_free(&text);
    return rc;
}
