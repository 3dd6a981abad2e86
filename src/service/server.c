/* SPDX-License-Identifier: Apache-2.0 */
/* The routing service's handle (include/kvmatch/server.h, docs/SERVICE.md): create (config,
 * pools, listeners, the loop's handles, the HTTP server, the scheduler thread), run (the loop
 * thread until drained, then persist), stop, destroy. The threads, what each owns and the lock
 * order: service/server_internal.h. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "base/error_detail.h"
#include "base/log_level.h"
#include "service/server_internal.h"

/* One line to the configured log callback, else to stderr with the "kvmatch serve: " prefix;
 * longer lines are cut at 511 bytes. Any thread. */
void km_srv_log(km_server *s, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (s->log)
        s->log(s->log_user, line);
    else
        fprintf(stderr, "kvmatch serve: %s\n", line + km_log_level_length(line));
}

void km_server_stop(km_server *server)
{
    if (!server)
        return;
    atomic_store(&server->stop_requested, true);
    uv_async_send(&server->wake);
}

static int parse_host_port(const char *text, char *host, size_t host_size, int *port)
{
    const char *colon = strrchr(text, ':');
    if (!colon || colon == text)
        return KM_ERR_INVALID_ARGUMENT;
    size_t hl = (size_t)(colon - text);
    const char *h = text;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl == 0 || hl >= host_size)
        return KM_ERR_INVALID_ARGUMENT;
    memcpy(host, h, hl);
    host[hl] = '\0';
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 0 || p > 65535 || end == colon + 1)
        return KM_ERR_INVALID_ARGUMENT;
    *port = (int)p;
    return KM_OK;
}

/* Does something accept connections on this Unix socket path? */
static bool unix_socket_answers(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    bool answers = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return answers;
}

/* A Unix socket path the kernel takes whole: not empty (an empty path would bind an abstract
 * socket no client can name), shorter than sun_path (a longer one would be cut), in a directory
 * that exists (bind reports a missing one as EACCES, which reads as a permission problem). */
static int check_socket_path(const char *path, char *why, size_t why_size)
{
    size_t max = sizeof ((struct sockaddr_un *)0)->sun_path - 1;
    size_t len = strlen(path);
    if (len == 0)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "the socket path is empty (give a path, or none for TCP only)");
    if (len > max)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "socket %s is %zu bytes long; a Unix socket path has 1..%zu bytes", path, len,
                      max);
    char dir[sizeof ((struct sockaddr_un *)0)->sun_path];
    memcpy(dir, path, len + 1);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    struct stat st;
    if (stat(dir, &st) != 0)
        return km_why(why, why_size, KM_ERR_IO, "socket %s: directory %s: %s", path, dir,
                      strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return km_why(why, why_size, KM_ERR_IO, "socket %s: %s is not a directory", path, dir);
    return KM_OK;
}

/* The records file can be opened for appending (created when missing): a directory, a read-only
 * file or directory, a missing directory is refused at start rather than found at the first
 * decision. A FIFO or device is taken as it is (opening a FIFO nobody reads would block). */
static int check_records_path(const char *path, char *why, size_t why_size)
{
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
        return KM_OK;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0)
        return km_why(why, why_size, KM_ERR_IO, "records %s cannot be written: %s", path,
                      strerror(errno));
    close(fd);
    return KM_OK;
}

static bool loopback_host(const char *h)
{
    return !strcmp(h, "127.0.0.1") || !strcmp(h, "::1") || !strcmp(h, "localhost") ||
           !strncmp(h, "127.", 4);
}

void km_server_destroy(km_server *s)
{
    if (!s)
        return;
    km_srv_scheduler_stop(s);
    km_http_stop(s->http);
    km_srv_scheduler_close_handles(s);
    /* Handles still open (destroy without run): close them and let the loop finish. */
    if (uv_loop_alive(&s->loop)) {
        while (s->conns)
            km_srv_conn_close(s->conns);
        if (s->have_unix && !uv_is_closing((uv_handle_t *)&s->unix_listener))
            uv_close((uv_handle_t *)&s->unix_listener, NULL);
        if (s->have_tcp && !uv_is_closing((uv_handle_t *)&s->tcp_listener))
            uv_close((uv_handle_t *)&s->tcp_listener, NULL);
        if (s->wake_inited && !uv_is_closing((uv_handle_t *)&s->wake))
            uv_close((uv_handle_t *)&s->wake, NULL);
        if (s->signals_installed) {
            uv_close((uv_handle_t *)&s->sigterm, NULL);
            uv_close((uv_handle_t *)&s->sigint, NULL);
            uv_close((uv_handle_t *)&s->sighup, NULL);
        }
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    uv_loop_close(&s->loop);
    for (job *j = s->queue_head; j;) {
        job *n = j->next;
        km_srv_job_free(j);
        j = n;
    }
    for (job *j = s->done_head; j;) {
        job *n = j->next;
        km_srv_job_free(j);
        j = n;
    }
    for (uint32_t i = 0; i < s->n_pools; i++)
        km_srv_pool_destroy(s->pools[i]);
    free(s->pools);
    if (s->workers)
        for (uint32_t i = 0; i < s->cfg.max_workers; i++) {
            free(s->workers[i].event_endpoint);
            free(s->workers[i].replay_endpoint);
            free(s->workers[i].metrics_url);
        }
    free(s->workers);
    uint64_t cursor = 0;
    for (km_u64map_entry *e; (e = km_u64map_next(&s->attempts_by_decision, &cursor));)
        km_srv_attempt_free(&s->attempt_cache, (attempt *)(uintptr_t)e->value);
    km_srv_attempt_cache_free(&s->attempt_cache);
    while (s->lessons) {
        dispatch_lesson *l = s->lessons;
        s->lessons = l->next;
        free(l);
    }
    km_u64map_free(&s->attempts_by_decision);
    km_cluster_destroy(s->cluster);
    km_srv_cluster_predictions_free(s); /* after the handle: no delivery queues one now */
    km_engine_metrics_destroy(s->engine_metrics);
    km_active_destroy(s->active);
    km_srv_scratch_free(&s->scratch);
    if (s->records) {
        km_record_writer_flush(s->records, 5000);
        km_record_writer_destroy(s->records);
    }
    km_metrics_destroy(s->metrics);
    if (s->own_socket_file)
        unlink(s->socket_path);
    pthread_mutex_destroy(&s->queue_lock);
    pthread_cond_destroy(&s->queue_cond);
    pthread_mutex_destroy(&s->done_lock);
    pthread_mutex_destroy(&s->admin_lock);
    pthread_mutex_destroy(&s->active_lock);
    pthread_mutex_destroy(&s->predictions_lock);
    pthread_mutex_destroy(&s->stored_lock);
    free(s->stored);
    free(s->socket_path);
    free(s->tcp);
    free(s->http_addr);
    free(s->records_path);
    free(s->snapshot_dir);
    free(s->default_pool);
    free(s->cluster_url);
    free(s->cluster_instance);
    free(s->cluster_subject);
    free(s);
}

static int dup_opt(const char *in, char **out)
{
    *out = NULL;
    if (!in)
        return KM_OK;
    *out = strdup(in);
    return *out ? KM_OK : KM_ERR_OUT_OF_MEMORY;
}

int km_server_create(const km_server_config *cfg_in, km_server **out, char *why, size_t why_size)
{
    if (!cfg_in || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or out is NULL");
    *out = NULL;
    km_server_config cfg = *cfg_in;
    if (!cfg.socket_path && !cfg.tcp)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "neither a socket path nor tcp");
    if (cfg.max_workers == 0 || cfg.max_workers > KM_MAX_WORKERS_LIMIT || cfg.max_batch_routes == 0 ||
        cfg.max_queued_routes == 0 || cfg.max_connections == 0 || cfg.max_outbox_bytes < 4096 ||
        cfg.max_outbox_bytes > KM_SERVER_MAX_OUTBOX_BYTES_LIMIT || cfg.frame_timeout_ms == 0 ||
        cfg.stalled_reader_timeout_ms == 0 ||
        cfg.active_ttl_ms == 0 || cfg.active_ttl_ms > UINT64_MAX / 1000000 || /* in ns */
        !(cfg.ready_share >= 0 && cfg.ready_share <= 1))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "max_workers, max_batch_routes, max_queued_routes, max_connections, "
                     "max_outbox_bytes (4096 .. 2^30), active_ttl_ms, ready_share, "
                     "frame_timeout_ms or stalled_reader_timeout_ms out of range");
    /* The cooldown is added to a time in ns (km_srv_breaker_outcome): bounded as the JSON config
     * and the CLI bound it, so the product cannot wrap to a short cooldown. */
    if (cfg.breaker_failures &&
        (cfg.breaker_cooldown_ms == 0 || cfg.breaker_cooldown_ms > UINT64_MAX / 1000000))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "breaker_cooldown_ms %" PRIu64 " is out of 1..%" PRIu64 " (in ns it must fit "
                     "64 bits)", cfg.breaker_cooldown_ms, UINT64_MAX / 1000000);
    if (cfg.limits.max_frame_bytes < KM_SERVER_MIN_FRAME_BYTES)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "limits.max_frame_bytes %u is under %u (a WELCOME or an ERROR would not fit)",
                     cfg.limits.max_frame_bytes, KM_SERVER_MIN_FRAME_BYTES);
    if (cfg.n_pools > MAX_POOLS)
        return km_why(why, why_size, KM_ERR_TOO_LARGE, "%u pools; at most %u", cfg.n_pools, MAX_POOLS);
    if (cfg.socket_path) {
        int rc = check_socket_path(cfg.socket_path, why, why_size);
        if (rc != KM_OK)
            return rc;
    }
    km_server *s = calloc(1, sizeof *s);
    if (!s)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "server");
    s->cfg = cfg;
    s->log = cfg.log;
    s->log_user = cfg.log_user;
    s->start_ns = now_ns();
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    s->start_wall_s = (double)wall.tv_sec + (double)wall.tv_nsec / 1e9;
    atomic_init(&s->next_decision_id, 1);
    atomic_init(&s->next_record_id, 1);
    pthread_mutex_init(&s->queue_lock, NULL);
    pthread_cond_init(&s->queue_cond, NULL);
    pthread_mutex_init(&s->done_lock, NULL);
    pthread_mutex_init(&s->admin_lock, NULL);
    pthread_mutex_init(&s->active_lock, NULL);
    pthread_mutex_init(&s->predictions_lock, NULL);
    pthread_mutex_init(&s->stored_lock, NULL);
    atomic_init(&s->stored_wanted, false);
    km_u64map_init(&s->attempts_by_decision, &s->attempts_memory);
    uv_loop_init(&s->loop);
    int rc = KM_OK;
    if (dup_opt(cfg.socket_path, &s->socket_path) || dup_opt(cfg.tcp, &s->tcp) ||
        dup_opt(cfg.http, &s->http_addr) || dup_opt(cfg.records_path, &s->records_path) ||
        dup_opt(cfg.snapshot_dir, &s->snapshot_dir) ||
        dup_opt(cfg.default_pool, &s->default_pool) ||
        dup_opt(cfg.cluster_url, &s->cluster_url) ||
        dup_opt(cfg.cluster_instance, &s->cluster_instance) ||
        dup_opt(cfg.cluster_subject, &s->cluster_subject))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "config strings");
    /* s->cfg's strings are the server's copies: the caller's may go after create, and a reload
     * compares them with a new configuration's. */
    s->cfg.socket_path = s->socket_path;
    s->cfg.tcp = s->tcp;
    s->cfg.http = s->http_addr;
    s->cfg.records_path = s->records_path;
    s->cfg.snapshot_dir = s->snapshot_dir;
    s->cfg.default_pool = s->default_pool;
    s->cfg.cluster_url = s->cluster_url;
    s->cfg.cluster_instance = s->cluster_instance;
    s->cfg.cluster_subject = s->cluster_subject;
    s->cfg.pools = NULL;
    s->cfg.n_pools = 0;
    if (!rc && !(s->pools = calloc(MAX_POOLS, sizeof *s->pools)))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "pools");
    if (!rc && !(s->workers = calloc(cfg.max_workers, sizeof *s->workers)))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "workers");
    if (!rc) {
        gethostname(s->host, sizeof s->host - 1);
        km_record_instance_id(s->instance);
        km_active_config ac;
        km_active_config_init(&ac);
        ac.max_workers = cfg.max_workers;
        ac.ttl_ns = cfg.active_ttl_ms * UINT64_C(1000000);
        ac.max_entries = cfg.max_active_entries;
        ac.max_bytes = cfg.max_active_bytes;
        if ((rc = km_active_create(&ac, &s->active)) != KM_OK)
            km_why(why, why_size, rc, "active work: %s", km_strerror(rc));
    }
    if (!rc && (rc = km_srv_metrics_setup(s)) != KM_OK)
        km_why(why, why_size, rc, "metrics: %s", km_strerror(rc));
    if (!rc && s->snapshot_dir) {
        struct stat st;
        if (stat(s->snapshot_dir, &st) != 0 && mkdir(s->snapshot_dir, 0755) != 0)
            rc = km_why(why, why_size, KM_ERR_IO, "snapshot dir %s: %s", s->snapshot_dir,
                       strerror(errno));
        else if (stat(s->snapshot_dir, &st) == 0 && !S_ISDIR(st.st_mode))
            /* Refused at the start: every snapshot in it would fail, the first at shutdown. */
            rc = km_why(why, why_size, KM_ERR_IO, "snapshot dir %s: %s", s->snapshot_dir,
                        strerror(ENOTDIR));
    }
    for (uint32_t i = 0; !rc && i < cfg.n_pools; i++) {
        const km_server_pool *pc = &cfg.pools[i];
        if (km_srv_pool_find(s, pc->name ? pc->name : "") >= 0) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "pool %s is listed twice", pc->name);
            break;
        }
        int serving = km_srv_pool_serving_model(s, pc->model, -1);
        if (serving >= 0) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                        "pool %s: model %s is served by pool %s already (a route naming a model "
                        "reaches one pool)", pc->name, pc->model, s->pools[serving]->name);
            break;
        }
        pool *p = NULL;
        if ((rc = km_srv_pool_create(s, pc, &p, why, why_size)) != KM_OK)
            break;
        s->pools[s->n_pools++] = p;
        for (uint32_t k = 0; !rc && k < pc->n_workers; k++)
            rc = km_srv_worker_add(s, s->n_pools - 1, &pc->workers[k], why, why_size);
    }
    if (!rc && s->default_pool && km_srv_pool_find(s, s->default_pool) < 0)
        rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "default_pool %s is not a pool",
                   s->default_pool);
    if (!rc && s->records_path)
        rc = check_records_path(s->records_path, why, why_size);
    if (!rc && s->records_path) {
        km_record_writer_config wc;
        km_record_writer_config_init(&wc);
        wc.path = s->records_path;
        wc.max_file_bytes = cfg.records_max_file_bytes;
        wc.keep_files = cfg.records_keep_files;
        wc.max_kept_bytes = cfg.records_max_kept_bytes;
        wc.max_age_s = cfg.records_max_age_s;
        /* A decision record lists every candidate, up to max_workers rows of under 1 KiB each (a
         * row of the largest numbers and an escaped 63-byte name is about 560 bytes). */
        uint64_t line_bytes = (UINT64_C(64) << 10) + (uint64_t)cfg.max_workers * 1024u;
        if (line_bytes > wc.max_line_bytes)
            wc.max_line_bytes = line_bytes;
        wc.log = s->log;
        wc.log_user = s->log_user;
        if ((rc = km_record_writer_create(&wc, &s->records)) != KM_OK)
            km_why(why, why_size, rc, "records %s: %s", s->records_path, km_strerror(rc));
    }
    /* Listeners. */
    if (!rc && s->socket_path) {
        uv_pipe_init(&s->loop, &s->unix_listener, 0);
        s->unix_listener.data = s;
        s->have_unix = true;
        /* A socket file left by a crashed run is replaced; one a live server answers on is not. */
        struct stat st;
        if (stat(s->socket_path, &st) == 0 && S_ISSOCK(st.st_mode)) {
            if (unix_socket_answers(s->socket_path))
                rc = km_why(why, why_size, KM_ERR_IO, "socket %s: another server is listening on it",
                           s->socket_path);
            else
                unlink(s->socket_path);
        }
        int e = rc ? 0 : uv_pipe_bind(&s->unix_listener, s->socket_path);
        if (!e && !rc)
            e = uv_listen((uv_stream_t *)&s->unix_listener, 511, km_srv_on_connection);
        if (rc) {
            /* reported above */
        } else if (e) {
            rc = km_why(why, why_size, KM_ERR_IO, "socket %s: %s", s->socket_path, uv_strerror(e));
        } else {
            s->own_socket_file = true;
            chmod(s->socket_path, 0660);
        }
    }
    if (!rc && s->tcp) {
        char host[128];
        int port;
        struct sockaddr_storage sa;
        if (parse_host_port(s->tcp, host, sizeof host, &port) != KM_OK) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "tcp \"%s\" is not HOST:PORT", s->tcp);
        } else if (!cfg.allow_non_loopback && !loopback_host(host)) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                       "tcp %s is not a loopback address (allow_non_loopback to permit it)", s->tcp);
        } else {
            if (!strcmp(host, "localhost"))
                snprintf(host, sizeof host, "127.0.0.1");
            int e = strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa)
                                      : uv_ip4_addr(host, port, (struct sockaddr_in *)&sa);
            uv_tcp_init(&s->loop, &s->tcp_listener);
            s->tcp_listener.data = s;
            s->have_tcp = true;
            if (!e)
                e = uv_tcp_bind(&s->tcp_listener, (struct sockaddr *)&sa, 0);
            if (!e)
                e = uv_listen((uv_stream_t *)&s->tcp_listener, 511, km_srv_on_connection);
            if (e)
                rc = km_why(why, why_size, KM_ERR_IO, "tcp %s: %s", s->tcp, uv_strerror(e));
            else {
                struct sockaddr_storage bound;
                int len = sizeof bound;
                uv_tcp_getsockname(&s->tcp_listener, (struct sockaddr *)&bound, &len);
                s->tcp_port = ntohs(bound.ss_family == AF_INET6
                                        ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                        : ((struct sockaddr_in *)&bound)->sin_port);
            }
        }
    }
    /* Before the probes answer: a cluster member is ready only with the peers' active work. */
    if (!rc)
        rc = km_srv_cluster_start(s, why, why_size);
    if (!rc) {
        uv_async_init(&s->loop, &s->wake, km_srv_on_wake);
        s->wake.data = s;
        s->wake_inited = true;
    }
    if (!rc && s->http_addr) {
        char host[128];
        int port;
        if (parse_host_port(s->http_addr, host, sizeof host, &port) != KM_OK) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "http \"%s\" is not HOST:PORT",
                       s->http_addr);
        } else {
            km_http_config hc;
            km_http_config_init(&hc);
            hc.bind_address = host;
            hc.port = (uint16_t)port;
            hc.allow_non_loopback = cfg.allow_non_loopback;
            hc.metrics = s->metrics;
            hc.callbacks = km_srv_http_callbacks(s);
            hc.log = s->log;
            hc.log_user = s->log_user;
            char herr[200];
            if ((rc = km_http_start(&hc, &s->http, herr, sizeof herr)) != KM_OK)
                km_why(why, why_size, rc, "http %s: %s", s->http_addr, herr);
            else
                s->http_port = km_http_port(s->http);
        }
    }
    if (!rc)
        rc = km_srv_scheduler_start(s, why, why_size);
    if (rc) {
        km_server_destroy(s);
        return rc;
    }
    *out = s;
    return KM_OK;
}

int km_server_run(km_server *s, bool install_signals)
{
    if (!s)
        return KM_ERR_NULL_POINTER;
    if (install_signals) {
        uv_signal_init(&s->loop, &s->sigterm);
        uv_signal_init(&s->loop, &s->sigint);
        uv_signal_init(&s->loop, &s->sighup);
        s->sigterm.data = s->sigint.data = s->sighup.data = s;
        uv_signal_start(&s->sigterm, km_srv_on_signal, SIGTERM);
        uv_signal_start(&s->sigint, km_srv_on_signal, SIGINT);
        uv_signal_start(&s->sighup, km_srv_on_hangup, SIGHUP);
        s->cfg_signals_ignore_hangup = true;
        s->signals_installed = true;
        signal(SIGPIPE, SIG_IGN);
    }
    /* The HTTP address as bound: a configured port 0 shows the port the system chose. */
    char http_desc[200] = "";
    char http_host[128];
    int http_configured_port;
    if (s->http_addr && parse_host_port(s->http_addr, http_host, sizeof http_host,
                                        &http_configured_port) == KM_OK)
        snprintf(http_desc, sizeof http_desc,
                 strchr(http_host, ':') ? ", http on [%s]:%u" : ", http on %s:%u", http_host,
                 s->http_port);
    km_srv_log(s, KM_LOG_INFO
               "serving on %s%s%s%s%s (%u pools)", s->socket_path ? s->socket_path : "",
               s->socket_path && s->tcp ? " and " : "", s->tcp ? "tcp " : "", s->tcp ? s->tcp : "",
               http_desc, s->n_pools);
    /* A peer that closes while its replies are written makes write() raise SIGPIPE, which ends
     * the process unless it is ignored: a program embedding the server (install_signals false)
     * need not ignore it. The signal is directed at the writing thread, this one, so blocking it
     * here turns it into EPIPE (the connection closes); the ones raised meanwhile are discarded
     * before the caller's mask is restored. */
    sigset_t pipe_only, caller_mask;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, &caller_mask);
    if (atomic_load(&s->stop_requested))
        km_srv_begin_drain(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    if (s->cfg_signals_ignore_hangup)
        signal(SIGHUP, SIG_IGN); /* the handle is closed: a late SIGHUP must not end the drain */
    struct timespec no_wait = {0, 0};
    while (sigtimedwait(&pipe_only, NULL, &no_wait) == SIGPIPE) {
    }
    pthread_sigmask(SIG_SETMASK, &caller_mask, NULL);
    /* Drained: stop the scheduler, then persist. */
    km_srv_scheduler_stop(s);
    /* A batch that ended after a drain timeout closed its connections: nothing is sent, but the
     * jobs and the closed connections they kept are freed. */
    km_srv_deliver_done(s);
    int status = KM_OK;
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (p->sub && p->snapshot_path) {
            int rc = km_subscriber_save(p->sub, NULL);
            if (rc != KM_OK) {
                km_srv_log(s, KM_LOG_ERROR "pool %s: snapshot not written: %s", p->name,
                           km_subscriber_last_error(p->sub));
                if (status == KM_OK)
                    status = rc;
            } else {
                km_srv_log(s, KM_LOG_INFO
                           "pool %s: snapshot written to %s", p->name, p->snapshot_path);
            }
        }
    }
    if (s->records) {
        int flushed = km_record_writer_flush(s->records, 10000);
        km_record_writer_counters rc;
        km_record_writer_stats(s->records, &rc);
        if (flushed == KM_ERR_TIMEOUT)
            km_srv_log(s, KM_LOG_ERROR
                       "records: %" PRIu64 " records still waiting after 10 s were not written "
                       "to %s", rc.pending, s->records_path);
        if (rc.failed > 0) {
            char last[256];
            km_record_writer_last_error(s->records, last, sizeof last);
            km_srv_log(s, KM_LOG_ERROR
                       "records: %" PRIu64 " of %" PRIu64 " records were lost to I/O errors "
                       "(last: %s)", rc.failed, rc.submitted, last);
        }
        if (flushed == KM_ERR_IO && rc.failed == 0)
            km_srv_log(s, KM_LOG_ERROR "records: syncing %s to disk failed; the last records may "
                       "not survive a crash", s->records_path);
        if (status == KM_OK && (rc.failed > 0 || flushed == KM_ERR_TIMEOUT || flushed == KM_ERR_IO))
            status = KM_ERR_IO;
    }
    km_http_stop(s->http);
    s->http = NULL;
    km_srv_log(s, KM_LOG_INFO "stopped");
    return status;
}

km_cluster *km_server_cluster(km_server *s)
{
    return s ? s->cluster : NULL;
}

uint16_t km_server_tcp_port(const km_server *s)
{
    return s ? s->tcp_port : 0;
}

uint16_t km_server_http_port(const km_server *s)
{
    return s ? s->http_port : 0;
}
