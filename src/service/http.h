/* SPDX-License-Identifier: Apache-2.0 */
/* The service's HTTP endpoint for probes and scrapes, on libmicrohttpd.
 *
 * Routes (GET, and HEAD which gets the same headers without the body):
 *   /healthz  200 "ok\n" for as long as the process serves HTTP (liveness: nothing is consulted)
 *   /readyz   200 "ready: <reason>\n" or 503 "not ready: <reason>\n" from the readiness callback
 *             (the service decides, e.g. ready only when the index is LIVE for a configured share
 *             of workers, so a restart's recovery window is visible to the orchestrator)
 *   /status   200 application/json, the text the status callback produces
 *   /metrics  200 text/plain; version=0.0.4: the registry's families, then what the metrics
 *             callback appends (service values computed at scrape time)
 * Any other path: 404. A known path with another method: 405 with "Allow: GET, HEAD". A request
 * with a body (Content-Length above 0, or Transfer-Encoding): 413, connection closed. A callback
 * that fails: 500 with "<KM_ERR_NAME>: <the text it wrote>". Query strings are ignored. Every
 * reply carries Cache-Control: no-store.
 *
 * Threads: one libmicrohttpd polling thread serves every connection, so the callbacks run on that
 * thread, one at a time, concurrently with the rest of the service: they must be thread-safe
 * against the service's own threads and quick (a slow callback delays every other probe; the
 * connection timeout does not interrupt it). They must not call km_http_stop.
 *
 * Exposure: the health, status and metrics of a router's placement engine are for this host's
 * agents; binding anything but a loopback address (127.0.0.0/8, ::1) is refused unless
 * allow_non_loopback is set.
 *
 * Lifecycle: km_http_config_init -> adjust -> km_http_start (the thread serves from its return) ->
 * km_http_port -> km_http_stop (closes every connection, joins the thread, frees the handle). */
#ifndef KVMATCH_HTTP_H
#define KVMATCH_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"
#include "kvmatch/metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_http km_http;

#define KM_HTTP_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define KM_HTTP_STATUS_CONTENT_TYPE "application/json"

/* Called on the HTTP thread (see above). `user` is km_http_callbacks.user. Each gets an empty
 * km_text (limit KM_TEXT_DEFAULT_MAX_BYTES); what it appends is the reply body. */
typedef struct km_http_callbacks {
    void *user;
    /* Ready to take traffic? Append a short reason either way ("9/10 workers LIVE, need 80%").
     * NULL: always ready, reason "no readiness check configured". */
    bool (*readiness)(void *user, km_text *reason);
    /* Append the /status JSON document; return KM_OK, or an error code after appending a sentence
     * saying what failed (the reply is then 500). NULL: the body is "{}". */
    int (*status_json)(void *user, km_text *json);
    /* Append service samples in the text format (km_prom_write_family / km_prom_write_sample)
     * after the registry's; return KM_OK or an error code after appending a sentence (the reply
     * is then 500, not a partial scrape). NULL: registry only. Families must not repeat names
     * the registry holds. */
    int (*append_metrics)(void *user, km_text *out);
} km_http_callbacks;

typedef struct km_http_config {
    const char *bind_address; /* numeric IPv4 or IPv6 address, or "localhost" (= 127.0.0.1);
                               * default "127.0.0.1" */
    uint16_t port;            /* 0 = an ephemeral port (km_http_port tells which); default 0 */
    bool allow_non_loopback;  /* permit a non-loopback bind_address; default false */
    km_metrics *metrics;      /* rendered at /metrics; NULL = none; must outlive the server */
    km_http_callbacks callbacks;
    uint32_t max_connections;      /* concurrent connections; more wait in the listen backlog
                                    * until one closes; default 1024, so idle keep-alive
                                    * connections do not lock the probes out */
    uint32_t connection_timeout_s; /* an idle connection is closed after this; default 3 (a
                                    * probe or a scrape takes milliseconds) */
    km_log_fn log;                 /* libmicrohttpd's error lines; NULL = stderr */
    void *log_user;
} km_http_config;

void km_http_config_init(km_http_config *cfg);

/* Bind, listen and start the serving thread. cfg NULL = defaults. On failure *out is NULL and
 * `error` (when not NULL, error_size > 0) holds "<KM_ERR_NAME>: <what failed>". Errors:
 * KM_ERR_NULL_POINTER (out), KM_ERR_INVALID_ARGUMENT (bind_address not numeric, not loopback
 * without allow_non_loopback; max_connections or connection_timeout_s 0), KM_ERR_IO (the address
 * could not be bound, e.g. the port is in use, or the thread did not start; libmicrohttpd's reason
 * is included), KM_ERR_OUT_OF_MEMORY. */
int km_http_start(const km_http_config *cfg, km_http **out, char *error, size_t error_size);

/* Stop accepting, close every open connection (a request being answered is cut off), join the
 * thread, free the handle. Returns within the time the callbacks in flight take to return. NULL is
 * a no-op. Not to be called from a callback. */
void km_http_stop(km_http *http);

/* The port bound (the chosen one when cfg.port was 0). */
uint16_t km_http_port(const km_http *http);
/* The address bound, as configured ("127.0.0.1"). */
const char *km_http_bind_address(const km_http *http);

/* Requests answered since start, by outcome. Safe from any thread. */
typedef struct km_http_stats {
    uint64_t requests;         /* every request answered, all outcomes below included */
    uint64_t not_found;        /* 404 */
    uint64_t bad_method;       /* 405 */
    uint64_t body_refused;     /* 413 */
    uint64_t callback_failed;  /* 500 */
} km_http_stats;

void km_http_get_stats(const km_http *http, km_http_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
