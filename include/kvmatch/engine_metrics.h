/* Engine-reported load: each worker's Prometheus endpoint (vLLM's or SGLang's /metrics) scraped at
 * an interval with libcurl, reduced to the three values a router weighs.
 *
 *   running   vllm:num_requests_running    sglang:num_running_reqs
 *   waiting   vllm:num_requests_waiting    sglang:num_queue_reqs
 *   kv_usage  vllm:kv_cache_usage_perc     sglang:token_usage          (0..1)
 *             (vllm:gpu_cache_usage_perc, its name before vLLM 0.10, is read too)
 *
 * Several series of one metric (labels: model_name, engine, data-parallel rank) are summed for
 * running and waiting; kv_usage takes the largest (the fullest cache decides what fits). A scrape
 * that fails (connection, HTTP status, timeout, a body over KM_ENGINE_METRICS_BODY_MAX, no known
 * metric in it) keeps the last good values and their time, counts the failure and keeps its
 * reason: the values' age says how fresh they are. This is what the engine says about all its
 * work, whoever routed it; it is as fresh as the interval.
 *
 * Threads: one scraper thread; every function may be called from any thread.
 * Lifecycle: km_engine_metrics_config_init -> adjust -> km_engine_metrics_create ->
 * km_engine_metrics_set_target / km_engine_metrics_get -> km_engine_metrics_destroy. */
#ifndef KVMATCH_ENGINE_METRICS_H
#define KVMATCH_ENGINE_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_engine_metrics km_engine_metrics;

/* Largest /metrics body read; a longer one fails the scrape. */
#define KM_ENGINE_METRICS_BODY_MAX (8u * 1024u * 1024u)

typedef struct km_engine_metrics_config {
    uint32_t max_workers; /* worker ids 0 .. max_workers-1; default 1024 */
    uint32_t interval_ms; /* between scrapes of one worker; >= 10; default 1000 */
    uint32_t timeout_ms;  /* one scrape at most; >= 1; default 500 */
    km_log_fn log;        /* may be NULL */
    void *log_user;
} km_engine_metrics_config;

void km_engine_metrics_config_init(km_engine_metrics_config *cfg);

/* What one worker's engine reported. NAN for a value its last good scrape did not carry. */
typedef struct km_engine_reported {
    bool has_values;      /* a scrape succeeded */
    const char *engine;   /* "vllm", "sglang", or NULL before the first good scrape (static) */
    double running, waiting, kv_usage;
    uint64_t scraped_ns;  /* CLOCK_MONOTONIC of the last good scrape; 0 when none */
    uint64_t scrapes, failures;
    char last_error[160]; /* the last failure's reason ("" when none) */
} km_engine_reported;

/* The age of the values at `now_ns` (CLOCK_MONOTONIC), in ns: 0 for a scrape that ended after
 * `now_ns` was read (the scraper thread stores it at any moment), UINT64_MAX when no scrape has
 * succeeded. Pure. */
uint64_t km_engine_reported_age_ns(const km_engine_reported *reported, uint64_t now_ns);

/* Parse one /metrics body into *out's values and engine (the counters and time untouched).
 * KM_ERR_PARSE when it holds none of the metrics above, or when a metric's series sum to more
 * than a double holds (reason in why). Pure: for the scraper and tests. */
int km_engine_metrics_parse(const char *text, size_t len, km_engine_reported *out, char *why,
                            size_t why_size);

/* Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT, KM_ERR_OUT_OF_MEMORY, KM_ERR_IO (libcurl
 * or the thread could not start); why (may be NULL) says which. */
int km_engine_metrics_create(const km_engine_metrics_config *cfg, km_engine_metrics **out,
                             char *why, size_t why_size);
void km_engine_metrics_destroy(km_engine_metrics *metrics); /* NULL is a no-op */

/* Scrape `url` ("http://HOST:PORT/metrics") for `worker` from now on; NULL stops and forgets the
 * worker's values. Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_INVALID_ARGUMENT (not
 * an http:// or https:// URL), KM_ERR_OUT_OF_MEMORY. */
int km_engine_metrics_set_target(km_engine_metrics *metrics, uint32_t worker, const char *url);

/* The worker's values now. Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_NOT_FOUND (no
 * target). */
int km_engine_metrics_get(km_engine_metrics *metrics, uint32_t worker, km_engine_reported *out);

#ifdef __cplusplus
}
#endif
#endif
