/* SPDX-License-Identifier: Apache-2.0 */
/* The loop thread's own work: a frame's dispatch by message type (HELLO first), delivery of
 * finished jobs' replies, the stop (signals, km_server_stop) and the drain that answers what was
 * sent before it. */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>

#include "kvmatch/log.h"
#include "kvmatch/server.h"
#include "kvmatch/version.h"
#include "service/server_internal.h"

void km_srv_count_bad_frame(km_server *s)
{
    atomic_fetch_add(&s->st.bad_frames, 1);
    km_counter_add(s->m_bad_frames, 1);
}

/* One frame. Returns false when the connection must close (after what was queued is written). */
bool km_srv_handle_frame(conn *c, const uint8_t *payload, size_t size)
{
    km_server *s = c->server;
    atomic_fetch_add(&s->st.frames, 1);
    km_counter_add(s->m_frames, 1);
    km_message m;
    int rc = km_protocol_decode(c->decoder, payload, size, &m);
    if (rc != KM_OK) {
        km_srv_count_bad_frame(s);
        if (!c->hello_done) { /* before HELLO, a frame that is not a readable HELLO ends it */
            if (m.type == KM_MESSAGE_HELLO)
                km_srv_send_error(c, m.has_id ? m.id : 0, rc, "HELLO: %s",
                                  km_protocol_decoder_last_error(c->decoder));
            else
                km_srv_send_error(c, m.has_id ? m.id : 0, KM_ERR_PROTOCOL,
                                  "the first message must be HELLO (this one is unreadable: %s)",
                                  km_protocol_decoder_last_error(c->decoder));
            return false;
        }
        km_srv_send_error(c, m.has_id ? m.id : 0, rc, "%s",
                          km_protocol_decoder_last_error(c->decoder));
        /* Without an id the peer cannot match replies, and an ERROR of id 0 is a
         * connection-level one: close. */
        return m.has_id && m.id != 0;
    }
    if (m.id == 0) {
        /* Id 0 is the server's, for connection-level errors: a reply to a request of id 0 could
         * not be told apart from one. */
        km_srv_count_bad_frame(s);
        km_srv_send_error(c, 0, KM_ERR_PROTOCOL,
                          "%s of id 0: id 0 is reserved for the server's connection-level "
                          "errors; a request's id is from 1",
                          km_message_type_name(m.type));
        return false;
    }
    if (!c->hello_done && m.type != KM_MESSAGE_HELLO) {
        km_srv_send_error(c, m.id, KM_ERR_PROTOCOL, "the first message must be HELLO, got %s",
                          km_message_type_name(m.type));
        return false;
    }
    switch (m.type) {
    case KM_MESSAGE_HELLO: {
        if (c->hello_done) {
            /* The handshake is done once: the version and limits it settled stand. */
            km_srv_send_error(c, m.id, KM_ERR_PROTOCOL,
                              "this connection's HELLO was already answered; one HELLO per "
                              "connection");
            return true;
        }
        if (m.hello.protocol_version != KM_PROTOCOL_VERSION) {
            km_srv_send_error(c, m.id, KM_ERR_INCOMPATIBLE,
                              "protocol version %u is not spoken here; this server speaks %u",
                              m.hello.protocol_version, KM_PROTOCOL_VERSION);
            return false;
        }
        km_message w;
        memset(&w, 0, sizeof w);
        w.type = KM_MESSAGE_WELCOME;
        w.has_id = true;
        w.id = m.id;
        w.welcome.protocol_version = KM_PROTOCOL_VERSION;
        w.welcome.kvmatch_version = KVMATCH_VERSION;
        w.welcome.server_name = "kvmatch serve";
        w.welcome.limits = s->cfg.limits;
        /* Handshaken only once its WELCOME is queued; else the ERROR that says why ends it. */
        if (km_srv_send_message(c, &w) != KM_OK)
            return false;
        c->hello_done = true;
        return true;
    }
    case KM_MESSAGE_ROUTE: km_srv_handle_route(c, &m); return true;
    case KM_MESSAGE_LIFECYCLE: km_srv_handle_lifecycle(c, &m); return true;
    case KM_MESSAGE_WORKERS: km_srv_handle_workers(c, &m); return true;
    case KM_MESSAGE_POOLS: km_srv_handle_pools(c, &m); return true;
    case KM_MESSAGE_STATUS: km_srv_handle_status(c, &m); return true;
    default:
        km_srv_send_error(c, m.id, KM_ERR_PROTOCOL, "%s is not a request a server answers",
                          km_message_type_name(m.type));
        return true;
    }
}

#ifdef KM_SRV_STAGE_TRACE
/* One line per delivered job to $KM_SRV_STAGE_LOG (opened at the first job; nothing when unset):
 * where it was decided (loop or scheduler), its routes, then each stage's time since the frame's
 * read in us: queued, batch, scored, decided, handed, picked, written (-1: left to a uv_write). */
static void stage_log(const job *j)
{
    static FILE *f;
    static bool opened;
    if (!opened) {
        opened = true;
        const char *path = getenv("KM_SRV_STAGE_LOG");
        f = path ? fopen(path, "w") : NULL;
    }
    if (!f)
        return;
    const job_stages *t = &j->stages;
#define SINCE_READ(v) ((v) ? (double)((int64_t)((v) - t->read)) / 1e3 : -1.0)
    fprintf(f, "%s %u %.1f %.1f %.1f %.1f %.1f %.1f %.1f\n", t->on_loop ? "loop" : "scheduler",
            j->n_routes, SINCE_READ(j->enqueued_ns), SINCE_READ(t->batch), SINCE_READ(t->scored),
            SINCE_READ(t->decided), SINCE_READ(t->handed), SINCE_READ(t->picked),
            SINCE_READ(t->written));
#undef SINCE_READ
}
#endif

/* Encode and send the replies of a list of finished jobs, then free them (loop thread). */
void km_srv_deliver_jobs(km_server *s, job *list)
{
    while (list) {
        job *j = list;
        list = j->next;
        conn *c = j->conn;
        KM_SRV_STAGE(j, picked);
        c->jobs_in_flight--;
        c->routes_in_flight -= j->n_routes;
        /* Its decisions never reach the router when its connection closed before the reply went
         * into the socket whole, or when the reply is an ERROR in their place. */
        bool lost = j->reply.size == 0 || j->reply_written < j->reply.size;
        if (!c->closing) {
            if (!j->encoded)
                km_srv_job_encode_reply(s, j);
            lost = !km_srv_conn_send_reply(c, j);
#ifdef KM_SRV_STAGE_TRACE
            if (!j->stages.written && !c->outbox.size && !c->write_in_flight)
                KM_SRV_STAGE(j, written);
            stage_log(j);
#endif
        }
        if (lost || j->decisions_lost)
            km_srv_end_job_undelivered(s, j);
        km_srv_job_free(j);
        if (c->closing)
            km_srv_conn_maybe_free(c);
        else
            km_srv_conn_close_if_finished(c);
    }
}

/* Deliver what the scheduler thread finished (its done list), on the loop thread. */
void km_srv_deliver_done(km_server *s)
{
    pthread_mutex_lock(&s->done_lock);
    job *list = s->done_head;
    s->done_head = s->done_tail = NULL;
    pthread_mutex_unlock(&s->done_lock);
    km_srv_deliver_jobs(s, list);
}

/* The loop's uv_async: finished jobs to deliver, or a stop km_server_stop requested. */
void km_srv_on_wake(uv_async_t *h)
{
    km_server *s = h->data;
    km_srv_deliver_done(s);
    if (atomic_load(&s->stop_requested) && !s->draining)
        km_srv_begin_drain(s);
}

static bool drained(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    bool idle = !s->queue_head && !s->scheduler_busy;
    pthread_mutex_unlock(&s->queue_lock);
    if (!idle)
        return false;
    pthread_mutex_lock(&s->done_lock);
    bool none = s->done_head == NULL;
    pthread_mutex_unlock(&s->done_lock);
    if (!none)
        return false;
    for (conn *c = s->conns; c; c = c->next) {
        if (c->jobs_in_flight || c->write_in_flight || c->outbox.size)
            return false;
        /* Requests a client sent before the stop may still be in its socket or half read: they
         * are read and answered (decided, or refused as shutting down) before the connection
         * closes, so a drain never ends between two reads with requests unanswered. */
        if (c->closing || c->eof)
            continue;
        if (km_frame_reader_pending(c->reader) > 0)
            return false;
        uv_os_fd_t fd;
        int unread = 0;
        if (c->reading && uv_fileno(&c->h.handle, &fd) == 0 && ioctl(fd, FIONREAD, &unread) == 0 &&
            unread > 0)
            return false;
    }
    return true;
}

static void close_everything(km_server *s)
{
    while (s->conns)
        km_srv_conn_close(s->conns);
    if (!uv_is_closing((uv_handle_t *)&s->wake))
        uv_close((uv_handle_t *)&s->wake, NULL);
    km_srv_scheduler_close_handles(s);
    if (s->drain_timer_started && !uv_is_closing((uv_handle_t *)&s->drain_timer))
        uv_close((uv_handle_t *)&s->drain_timer, NULL);
    if (s->signals_installed) {
        uv_close((uv_handle_t *)&s->sigterm, NULL);
        uv_close((uv_handle_t *)&s->sigint, NULL);
        uv_close((uv_handle_t *)&s->sighup, NULL);
        s->signals_installed = false;
    }
}

/* The drain timed out: routes still queued are dropped unanswered (their connections close now;
 * deciding them would only begin active work and write decision records for replies nobody can
 * read). Returns how many. A batch being scored ends normally, and km_server_run delivers it
 * (freeing its closed connection) after joining the scheduler. */
static uint64_t drop_queued(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    job *list = s->queue_head;
    s->queue_head = s->queue_tail = s->queue_light_tail = NULL;
    uint64_t routes = s->queued_routes;
    s->queued_routes = 0;
    s->queued_big_frames = 0;
    pthread_mutex_unlock(&s->queue_lock);
    while (list) {
        job *j = list;
        list = j->next;
        j->conn->jobs_in_flight--;
        j->conn->routes_in_flight -= j->n_routes;
        if (j->behind)
            j->conn->queued_behind--;
        km_srv_job_free(j);
    }
    return routes;
}

static void on_drain_tick(uv_timer_t *t)
{
    km_server *s = t->data;
    km_srv_deliver_done(s);
    if (drained(s) || now_ns() >= s->drain_deadline_ns) {
        if (!drained(s)) {
            uint64_t dropped = drop_queued(s);
            atomic_fetch_add(&s->st.dropped_at_shutdown, dropped);
            km_srv_log(s, KM_LOG_WARNING
                       "drain timeout: closing with work unfinished (%" PRIu64 " queued routes "
                       "dropped unanswered; a batch being scored ends first)", dropped);
        }
        uv_timer_stop(t);
        close_everything(s);
    }
}

/* Stop accepting connections and routes, then finish what was sent before (answered, or dropped
 * at drain_timeout_ms) and close everything, which ends km_server_run's loop. Idempotent. */
void km_srv_begin_drain(km_server *s)
{
    if (s->draining)
        return;
    s->draining = true;
    km_srv_log(s, KM_LOG_INFO "stopping: no new connections or routes; finishing queued decisions");
    if (s->have_unix && !uv_is_closing((uv_handle_t *)&s->unix_listener))
        uv_close((uv_handle_t *)&s->unix_listener, NULL);
    if (s->have_tcp && !uv_is_closing((uv_handle_t *)&s->tcp_listener))
        uv_close((uv_handle_t *)&s->tcp_listener, NULL);
    s->drain_deadline_ns = now_ns() + (uint64_t)s->cfg.drain_timeout_ms * 1000000u;
    uv_timer_init(&s->loop, &s->drain_timer);
    s->drain_timer.data = s;
    s->drain_timer_started = true;
    uv_timer_start(&s->drain_timer, on_drain_tick, 0, 5);
}

void km_srv_on_hangup(uv_signal_t *h, int signum)
{
    (void)signum;
    km_server *s = h->data;
    if (s->draining) {
        km_srv_log(s, KM_LOG_INFO "SIGHUP received while draining: ignored");
        return;
    }
    if (s->records) {
        km_record_writer_reopen(s->records);
        km_srv_log(s, KM_LOG_INFO "SIGHUP received: records file %s reopened", s->records_path);
    } else {
        km_srv_log(s, KM_LOG_INFO "SIGHUP received");
    }
    if (s->cfg.on_hangup)
        s->cfg.on_hangup(s, s->cfg.hangup_user);
}

/* SIGTERM or SIGINT (km_server_run installs them): drain and stop. */
void km_srv_on_signal(uv_signal_t *h, int signum)
{
    km_server *s = h->data;
    km_srv_log(s, KM_LOG_INFO "%s received", signum == SIGTERM ? "SIGTERM" : "SIGINT");
    atomic_store(&s->stop_requested, true);
    km_srv_begin_drain(s);
}
