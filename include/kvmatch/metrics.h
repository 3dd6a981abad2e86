/* SPDX-License-Identifier: Apache-2.0 */
/* Metrics: counters, gauges and fixed-bucket histograms that many threads update without locks
 * (C11 atomics, relaxed order), kept in a registry that renders them in the Prometheus text
 * exposition format 0.0.4 (https://prometheus.io/docs/instrumenting/exposition_formats/), plus a
 * quantile estimate from a histogram (p50 / p99 for STATUS replies) and the writer helpers a
 * service uses to append its own samples at scrape time.
 *
 * Model. A metric *family* is a name, a help text, a type and (histograms) bucket bounds; a
 * *series* is a family plus one label set ({worker="3",state="LIVE"}). Registering returns the
 * series' handle; updating a handle is one atomic operation (a histogram observation: three) and
 * never allocates, locks or fails. Handles stay valid until km_metrics_destroy; a registry never
 * forgets a series, so values whose label sets come and go at run time (per-worker states of a
 * pool that changes) are better written at scrape time with km_prom_write_* into the text the
 * service appends (the HTTP server's metrics callback).
 *
 * Lifecycle: km_metrics_create -> km_metrics_add_* (any time, any thread) -> updates (any thread)
 * -> km_metrics_render (any thread) -> km_metrics_destroy (no other call in flight, no handle used
 * afterwards).
 *
 * Thread-safety: registration and rendering take the registry's mutex; km_counter_*, km_gauge_*
 * and km_histogram_* take no lock and may run on any number of threads at once. A render running
 * during updates sees each value atomically, but a histogram's _sum may lag its buckets by the
 * observations in flight; its _count always equals its +Inf bucket (both come from one read of
 * the buckets). */
#ifndef KVMATCH_METRICS_H
#define KVMATCH_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/text.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- registry ---------------------------------------------------------------------------------- */

typedef struct km_metrics km_metrics;
typedef struct km_counter km_counter;
typedef struct km_gauge km_gauge;
typedef struct km_histogram km_histogram;

/* One label of a series. Names follow Prometheus: [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__";
 * "le" is reserved (histogram buckets). Values are any UTF-8 text; rendering escapes backslash,
 * double quote and newline. */
typedef struct km_metric_label {
    const char *name;
    const char *value;
} km_metric_label;

/* Limits checked at registration (KM_ERR_TOO_LARGE beyond them). */
#define KM_METRICS_NAME_MAX 200u          /* bytes of a metric or label name */
#define KM_METRICS_HELP_MAX 1024u         /* bytes of a help text */
#define KM_METRICS_LABEL_VALUE_MAX 1024u  /* bytes of a label value */
#define KM_METRICS_LABELS_MAX 16u         /* labels per series */
#define KM_METRICS_BUCKETS_MAX 64u        /* finite bucket bounds per histogram */

/* Errors: KM_ERR_NULL_POINTER, KM_ERR_OUT_OF_MEMORY. */
int km_metrics_create(km_metrics **out);
void km_metrics_destroy(km_metrics *registry); /* NULL is a no-op */

/* Detail of the last failed registration on this handle ("" when none); valid until the next
 * failing call. Concurrent failing registrations overwrite each other's detail. */
const char *km_metrics_last_error(const km_metrics *registry);

/* Register a series, or find it: the same name and label set again returns the same handle.
 * Series of one family render together, in registration order, under one # HELP / # TYPE.
 *   name   metric name, [a-zA-Z_:][a-zA-Z0-9_:]*; a counter's name should end in _total
 *   help   one line of text (backslash and newline are escaped when rendered); NULL = ""
 *   labels label_count labels (NULL when 0); every series of a family must use the same label
 *          names in the same order, and the first registration fixes the family's help text
 * Errors: KM_ERR_NULL_POINTER (registry, name, out, a label's name or value),
 * KM_ERR_INVALID_ARGUMENT (a bad metric or label name, a label name repeated, the name already
 * registered with another type, help, label names or buckets), KM_ERR_TOO_LARGE (a limit above),
 * KM_ERR_OUT_OF_MEMORY. On failure *out is NULL and the registry is unchanged. */
int km_metrics_add_counter(km_metrics *registry, const char *name, const char *help,
                           const km_metric_label *labels, size_t label_count, km_counter **out);
int km_metrics_add_gauge(km_metrics *registry, const char *name, const char *help,
                         const km_metric_label *labels, size_t label_count, km_gauge **out);
/* bounds: bound_count finite upper bounds, strictly ascending (1 .. KM_METRICS_BUCKETS_MAX); the
 * +Inf bucket is implicit. Errors also: KM_ERR_INVALID_ARGUMENT for bounds that are not finite or
 * not strictly ascending, or bound_count 0. */
int km_metrics_add_histogram(km_metrics *registry, const char *name, const char *help,
                             const km_metric_label *labels, size_t label_count,
                             const double *bounds, size_t bound_count, km_histogram **out);

/* Append every registered family to `out` in the text format 0.0.4 (families in registration
 * order). Returns out->status: KM_OK, KM_ERR_OUT_OF_MEMORY, KM_ERR_TOO_LARGE; KM_ERR_NULL_POINTER. */
int km_metrics_render(km_metrics *registry, km_text *out);
/* The same into a caller buffer: writes at most capacity bytes including the NUL and sets *needed
 * (when not NULL) to the full length plus one. Errors: KM_ERR_TOO_LARGE when it did not fit (buffer
 * then holds a NUL-terminated prefix when capacity > 0), KM_ERR_NULL_POINTER, KM_ERR_OUT_OF_MEMORY. */
int km_metrics_render_to_buffer(km_metrics *registry, char *buffer, size_t capacity,
                                size_t *needed);

/* ---- updates (lock-free; a NULL handle is a no-op, reads of NULL give 0) ------------------------ */

void km_counter_add(km_counter *counter, uint64_t amount); /* wraps at 2^64 */
static inline void km_counter_increment(km_counter *counter) { km_counter_add(counter, 1); }
uint64_t km_counter_value(const km_counter *counter);

void km_gauge_set(km_gauge *gauge, double value);
void km_gauge_add(km_gauge *gauge, double delta); /* negative delta subtracts */
double km_gauge_value(const km_gauge *gauge);

/* Count `value` in the first bucket whose bound is >= value (the +Inf bucket when above all) and
 * add it to the sum. NaN is ignored (not counted). */
void km_histogram_observe(km_histogram *histogram, double value);
uint64_t km_histogram_count(const km_histogram *histogram);
double km_histogram_sum(const km_histogram *histogram);

/* Estimate of the q-quantile (0 <= q <= 1) of what was observed, as Prometheus'
 * histogram_quantile() computes it: the bucket holding the observation of rank max(1, ceil(q *
 * count)) is found, and the value is interpolated linearly inside it (the first bucket's lower
 * end is 0 when its bound is positive, else the bound itself). So the estimate lies in the same
 * bucket as the true sample quantile. When that bucket is +Inf the result is the largest finite
 * bound. NaN when nothing was observed, q is outside [0, 1] or NaN, or histogram is NULL. */
double km_histogram_quantile(const km_histogram *histogram, double q);

/* ---- standard bucket bounds ------------------------------------------------------------------- */

/* Batch sizes: 1, 2, 4, ..., 4096 (13 bounds). */
const double *km_metrics_batch_size_buckets(size_t *count);
/* Latencies in seconds, 1-2.5-5 steps from 10 us to 1 s: 1e-5, 2.5e-5, 5e-5, 1e-4, ..., 0.5, 1
 * (16 bounds). */
const double *km_metrics_latency_buckets_seconds(size_t *count);

/* ---- writing samples directly (for values produced at scrape time) ---------------------------- */

/* The metric types, and the words of their # TYPE lines; the values follow the list's order
 * from 0. */
#define KM_METRIC_TYPE_LIST(X)          \
    X(KM_METRIC_COUNTER, "counter")     \
    X(KM_METRIC_GAUGE, "gauge")         \
    X(KM_METRIC_HISTOGRAM, "histogram") \
    X(KM_METRIC_UNTYPED, "untyped")

typedef enum km_metric_type {
#define KM_METRIC_TYPE_ENUM(value, name) value,
    KM_METRIC_TYPE_LIST(KM_METRIC_TYPE_ENUM)
#undef KM_METRIC_TYPE_ENUM
} km_metric_type;

/* The word in KM_METRIC_TYPE_LIST; "untyped" for any other value. */
const char *km_metric_type_name(km_metric_type type);

/* "# HELP name help\n# TYPE name type\n" with help escaped. Write it once per family, before the
 * family's samples. Errors: KM_ERR_INVALID_ARGUMENT (a bad name; nothing is written), or
 * out->status. */
int km_prom_write_family(km_text *out, const char *name, const char *help, km_metric_type type);
/* One sample line: name{labels} value. Values print exactly (shortest text that reads back as the
 * same double; "NaN", "+Inf", "-Inf"); label values are escaped. Errors: KM_ERR_INVALID_ARGUMENT
 * (a bad metric or label name; nothing is written), KM_ERR_NULL_POINTER, or out->status. */
int km_prom_write_sample(km_text *out, const char *name, const km_metric_label *labels,
                         size_t label_count, double value);
int km_prom_write_sample_u64(km_text *out, const char *name, const km_metric_label *labels,
                             size_t label_count, uint64_t value);
/* Append `value` to out with Prometheus label-value escaping (\\, \", \n). */
int km_prom_escape_label_value(km_text *out, const char *value);
/* Is `name` a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*, 1 .. KM_METRICS_NAME_MAX bytes)? */
int km_prom_valid_metric_name(const char *name);
/* Is `name` a valid label name ([a-zA-Z_][a-zA-Z0-9_]*, not "__..."; 1 .. KM_METRICS_NAME_MAX)? */
int km_prom_valid_label_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif
