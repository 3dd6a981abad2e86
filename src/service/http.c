/* SPDX-License-Identifier: Apache-2.0 */
/* Health, readiness, status and metrics over HTTP (src/service/http.h), on libmicrohttpd's internal
 * polling thread.
 *
 * None of the routes takes a body. A request announcing one is answered in the access handler's
 * first call, when only the headers have been read (413, or the 404 / 405 its path or method
 * earns first), and libmicrohttpd closes that connection afterwards since the body is never
 * consumed. Every other request is answered in the handler's second call, once libmicrohttpd has
 * read the whole request: a reply queued earlier would make it discard the rest of the stream and
 * close the connection, so a keep-alive client (a scraper, a probe) could send only one request
 * per connection. Replies own a malloc'd body (the km_text the callbacks filled), handed to
 * libmicrohttpd with MHD_RESPMEM_MUST_FREE. */
#include "service/http.h"
#include "base/error_detail.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#define BIND_ADDRESS_MAX 64u

struct km_http {
    struct MHD_Daemon *daemon;
    km_metrics *metrics;
    km_http_callbacks callbacks;
    km_log_fn log;
    void *log_user;
    char bind_address[BIND_ADDRESS_MAX];
    uint16_t port;
    /* libmicrohttpd's last log line while starting, for the error of a failed start. */
    char start_log[256];
    atomic_bool starting;
    _Atomic uint64_t requests, not_found, bad_method, body_refused, callback_failed;
};

typedef enum route {
    ROUTE_NONE = 0,
    ROUTE_HEALTHZ,
    ROUTE_READYZ,
    ROUTE_STATUS,
    ROUTE_METRICS,
} route;

void km_http_config_init(km_http_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->bind_address = "127.0.0.1";
    cfg->port = 0;
    cfg->allow_non_loopback = false;
    cfg->max_connections = 1024;
    cfg->connection_timeout_s = 3;
}

static int start_fail(char *error, size_t error_size, int status, const char *format, ...)
    __attribute__((format(printf, 4, 5)));

static int start_fail(char *error, size_t error_size, int status, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    km_vstatus_message(error, error_size, status, format, ap);
    va_end(ap);
    return status;
}

/* libmicrohttpd's error lines: to the configured log (or stderr), and kept while starting. */
/* libmicrohttpd calls its logger for its error messages and gives them no level: most concern one
 * client connection, which the service survives, and a listener that cannot start is reported by
 * km_http_start's own error; so they are written at the fixed level KM_LOG_WARNING. */
static void mhd_logger(void *cls, const char *format, va_list ap)
{
    km_http *http = cls;
    char line[512];
    int n = snprintf(line, sizeof line, KM_LOG_WARNING "http: ");
    vsnprintf(line + n, sizeof line - (size_t)n, format, ap);
    size_t length = strlen(line);
    while (length && (line[length - 1] == '\n' || line[length - 1] == '\r'))
        line[--length] = '\0';
    if (atomic_load(&http->starting))
        snprintf(http->start_log, sizeof http->start_log, "%s", line + n);
    if (http->log)
        http->log(http->log_user, line);
    else
        fprintf(stderr, "kvmatch: %s\n", line + strlen(KM_LOG_WARNING));
}

/* Parse and check the bind address into *storage; sets *length and *ipv6. */
static int resolve_bind_address(const km_http_config *cfg, struct sockaddr_storage *storage,
                                socklen_t *length, bool *ipv6, char *error, size_t error_size)
{
    const char *address = cfg->bind_address ? cfg->bind_address : "127.0.0.1";
    if (strcmp(address, "localhost") == 0)
        address = "127.0.0.1";
    if (strlen(address) >= BIND_ADDRESS_MAX)
        return start_fail(error, error_size, KM_ERR_INVALID_ARGUMENT,
                          "bind address is longer than %u bytes", BIND_ADDRESS_MAX - 1);
    memset(storage, 0, sizeof *storage);
    bool loopback;
    struct sockaddr_in *v4 = (struct sockaddr_in *)storage;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)storage;
    if (inet_pton(AF_INET, address, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(cfg->port);
        *length = sizeof *v4;
        *ipv6 = false;
        loopback = (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
    } else if (inet_pton(AF_INET6, address, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(cfg->port);
        *length = sizeof *v6;
        *ipv6 = true;
        const uint8_t *b = v6->sin6_addr.s6_addr;
        loopback = IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr) ||
                   (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr) && b[12] == 127);
    } else {
        return start_fail(error, error_size, KM_ERR_INVALID_ARGUMENT,
                          "bind address \"%s\" is not a numeric IPv4 or IPv6 address", address);
    }
    if (!loopback && !cfg->allow_non_loopback)
        return start_fail(error, error_size, KM_ERR_INVALID_ARGUMENT,
                          "bind address %s is not a loopback address (127.0.0.0/8 or ::1); health, "
                          "status and metrics stay on this host unless allow_non_loopback is set",
                          address);
    return KM_OK;
}

static route route_of(const char *url)
{
    if (strcmp(url, "/healthz") == 0)
        return ROUTE_HEALTHZ;
    if (strcmp(url, "/readyz") == 0)
        return ROUTE_READYZ;
    if (strcmp(url, "/status") == 0)
        return ROUTE_STATUS;
    if (strcmp(url, "/metrics") == 0)
        return ROUTE_METRICS;
    return ROUTE_NONE;
}

/* Queue a reply whose body is `text` (taken: freed here or by libmicrohttpd). */
static enum MHD_Result reply_text(struct MHD_Connection *connection, unsigned int code,
                                  const char *content_type, km_text *text, const char *allow)
{
    struct MHD_Response *response;
    if (text->data && text->length) {
        response = MHD_create_response_from_buffer(text->length, text->data,
                                                   MHD_RESPMEM_MUST_FREE);
        if (response)
            text->data = NULL; /* libmicrohttpd owns it now */
    } else {
        response = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    }
    km_text_free(text);
    if (!response)
        return MHD_NO; /* out of memory: libmicrohttpd closes the connection */
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    MHD_add_response_header(response, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (allow)
        MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result result = MHD_queue_response(connection, code, response);
    MHD_destroy_response(response);
    return result;
}

static enum MHD_Result reply_plain(struct MHD_Connection *connection, unsigned int code,
                                   const char *body, const char *allow)
{
    km_text text;
    km_text_init(&text, 0);
    km_text_append_cstr(&text, body);
    return reply_text(connection, code, "text/plain; charset=utf-8", &text, allow);
}

/* 500 with "<KM_ERR_NAME>: <what the callback wrote>". */
static enum MHD_Result reply_callback_failure(km_http *http, struct MHD_Connection *connection,
                                              const char *what, int status, km_text *detail)
{
    atomic_fetch_add(&http->callback_failed, 1);
    km_text body;
    km_text_init(&body, 0);
    km_text_printf(&body, "%s: %s callback failed: %s\n", km_error_name(status), what,
                   detail->status == KM_OK ? km_text_cstr(detail) : km_strerror(detail->status));
    km_text_free(detail);
    return reply_text(connection, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8",
                      &body, NULL);
}

static bool request_has_body(struct MHD_Connection *connection)
{
    if (MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                    MHD_HTTP_HEADER_TRANSFER_ENCODING))
        return true;
    const char *length = MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (!length)
        return false;
    while (*length == ' ' || *length == '\t')
        length++;
    for (; *length == '0'; length++)
        ;
    return *length != '\0' && *length != ' ' && *length != '\t';
}

static enum MHD_Result serve_readyz(km_http *http, struct MHD_Connection *connection)
{
    km_text reason;
    km_text_init(&reason, 0);
    bool ready = true;
    if (http->callbacks.readiness)
        ready = http->callbacks.readiness(http->callbacks.user, &reason);
    else
        km_text_append_cstr(&reason, "no readiness check configured");
    km_text body;
    km_text_init(&body, 0);
    km_text_append_cstr(&body, ready ? "ready" : "not ready");
    if (reason.length)
        km_text_printf(&body, ": %s", km_text_cstr(&reason));
    km_text_append_cstr(&body, "\n");
    km_text_free(&reason);
    return reply_text(connection, ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE,
                      "text/plain; charset=utf-8", &body, NULL);
}

static enum MHD_Result serve_status(km_http *http, struct MHD_Connection *connection)
{
    km_text json;
    km_text_init(&json, 0);
    int rc = KM_OK;
    if (http->callbacks.status_json)
        rc = http->callbacks.status_json(http->callbacks.user, &json);
    else
        km_text_append_cstr(&json, "{}");
    if (rc == KM_OK && json.status != KM_OK)
        rc = json.status;
    if (rc != KM_OK)
        return reply_callback_failure(http, connection, "status", rc, &json);
    return reply_text(connection, MHD_HTTP_OK, KM_HTTP_STATUS_CONTENT_TYPE, &json, NULL);
}

static enum MHD_Result serve_metrics(km_http *http, struct MHD_Connection *connection)
{
    km_text text;
    km_text_init(&text, 0);
    int rc = KM_OK;
    if (http->metrics)
        rc = km_metrics_render(http->metrics, &text);
    if (rc != KM_OK) {
        km_text detail;
        km_text_init(&detail, 0);
        km_text_append_cstr(&detail, "rendering the registry failed");
        km_text_free(&text);
        return reply_callback_failure(http, connection, "metrics", rc, &detail);
    }
    if (http->callbacks.append_metrics) {
        size_t registry_length = text.length;
        rc = http->callbacks.append_metrics(http->callbacks.user, &text);
        if (rc == KM_OK && text.status != KM_OK)
            rc = text.status;
        if (rc != KM_OK) {
            /* Keep only what the callback wrote: its sentence. */
            km_text detail;
            km_text_init(&detail, 0);
            if (text.status == KM_OK)
                km_text_append(&detail, text.data + registry_length, text.length - registry_length);
            else
                km_text_append_cstr(&detail, km_strerror(text.status));
            km_text_free(&text);
            return reply_callback_failure(http, connection, "metrics", rc, &detail);
        }
    }
    return reply_text(connection, MHD_HTTP_OK, KM_HTTP_METRICS_CONTENT_TYPE, &text, NULL);
}

static enum MHD_Result handle_request(void *cls, struct MHD_Connection *connection,
                                      const char *url, const char *method, const char *version,
                                      const char *upload_data, size_t *upload_data_size,
                                      void **request_state)
{
    (void)version;
    (void)upload_data;
    (void)upload_data_size;
    km_http *http = cls;
    static int headers_read; /* *request_state once the first call passed a request on */
    bool has_body = request_has_body(connection);
    if (*request_state == NULL) {
        atomic_fetch_add(&http->requests, 1);
        if (!has_body) {
            *request_state = &headers_read; /* answered in the next call: the request is whole */
            return MHD_YES;
        }
    }
    route r = route_of(url);
    if (r == ROUTE_NONE) {
        atomic_fetch_add(&http->not_found, 1);
        return reply_plain(connection, MHD_HTTP_NOT_FOUND,
                           "not found: the routes are /healthz /readyz /status /metrics\n", NULL);
    }
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
        atomic_fetch_add(&http->bad_method, 1);
        return reply_plain(connection, MHD_HTTP_METHOD_NOT_ALLOWED,
                           "method not allowed: use GET or HEAD\n", "GET, HEAD");
    }
    if (has_body) {
        atomic_fetch_add(&http->body_refused, 1);
        return reply_plain(connection, MHD_HTTP_CONTENT_TOO_LARGE,
                           "request bodies are not accepted\n", NULL);
    }
    switch (r) {
    case ROUTE_HEALTHZ:
        return reply_plain(connection, MHD_HTTP_OK, "ok\n", NULL);
    case ROUTE_READYZ:
        return serve_readyz(http, connection);
    case ROUTE_STATUS:
        return serve_status(http, connection);
    case ROUTE_METRICS:
        return serve_metrics(http, connection);
    default:
        return MHD_NO;
    }
}

int km_http_start(const km_http_config *cfg, km_http **out, char *error, size_t error_size)
{
    if (error && error_size)
        error[0] = '\0';
    if (!out)
        return start_fail(error, error_size, KM_ERR_NULL_POINTER, "out is NULL");
    *out = NULL;
    km_http_config defaults;
    if (!cfg) {
        km_http_config_init(&defaults);
        cfg = &defaults;
    }
    if (cfg->max_connections == 0 || cfg->connection_timeout_s == 0)
        return start_fail(error, error_size, KM_ERR_INVALID_ARGUMENT,
                          "max_connections and connection_timeout_s must be at least 1");
    struct sockaddr_storage address;
    socklen_t address_length = 0;
    bool ipv6 = false;
    int rc = resolve_bind_address(cfg, &address, &address_length, &ipv6, error, error_size);
    if (rc != KM_OK)
        return rc;

    km_http *http = calloc(1, sizeof *http);
    if (!http)
        return start_fail(error, error_size, KM_ERR_OUT_OF_MEMORY, "no memory for the handle");
    http->metrics = cfg->metrics;
    http->callbacks = cfg->callbacks;
    http->log = cfg->log;
    http->log_user = cfg->log_user;
    snprintf(http->bind_address, sizeof http->bind_address, "%s",
             cfg->bind_address && strcmp(cfg->bind_address, "localhost") != 0 ? cfg->bind_address
                                                                                : "127.0.0.1");
    atomic_init(&http->starting, true);
    atomic_init(&http->requests, 0);
    atomic_init(&http->not_found, 0);
    atomic_init(&http->bad_method, 0);
    atomic_init(&http->body_refused, 0);
    atomic_init(&http->callback_failed, 0);

    unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG |
                         MHD_USE_ITC | (ipv6 ? MHD_USE_IPv6 : 0);
    errno = 0;
    http->daemon = MHD_start_daemon(
        flags, cfg->port, NULL, NULL, handle_request, http,
        MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, http, /* first, so every line goes through it */
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&address,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned int)cfg->max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)cfg->connection_timeout_s,
        MHD_OPTION_END);
    int saved_errno = errno;
    atomic_store(&http->starting, false);
    if (!http->daemon) {
        rc = start_fail(error, error_size, KM_ERR_IO, "cannot serve HTTP on %s port %u: %s",
                        http->bind_address, (unsigned)cfg->port,
                        http->start_log[0] ? http->start_log
                        : saved_errno    ? strerror(saved_errno)
                                         : "libmicrohttpd refused to start");
        free(http);
        return rc;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(http->daemon, MHD_DAEMON_INFO_BIND_PORT);
    http->port = info ? info->port : cfg->port;
    if (http->port == 0) {
        MHD_stop_daemon(http->daemon);
        free(http);
        return start_fail(error, error_size, KM_ERR_IO, "libmicrohttpd did not report its port");
    }
    *out = http;
    return KM_OK;
}

void km_http_stop(km_http *http)
{
    if (!http)
        return;
    MHD_stop_daemon(http->daemon);
    free(http);
}

uint16_t km_http_port(const km_http *http)
{
    return http ? http->port : 0;
}

const char *km_http_bind_address(const km_http *http)
{
    return http ? http->bind_address : "";
}

void km_http_get_stats(const km_http *http, km_http_stats *stats)
{
    if (!stats)
        return;
    memset(stats, 0, sizeof *stats);
    if (!http)
        return;
    km_http *h = (km_http *)http;
    stats->requests = atomic_load(&h->requests);
    stats->not_found = atomic_load(&h->not_found);
    stats->bad_method = atomic_load(&h->bad_method);
    stats->body_refused = atomic_load(&h->body_refused);
    stats->callback_failed = atomic_load(&h->callback_failed);
}
