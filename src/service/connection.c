/* SPDX-License-Identifier: Apache-2.0 */
/* A router connection's lifetime on the loop thread: accepted, read into frames (each handed to
 * km_srv_handle_frame), its replies queued and written (uv_try_write first, uv_write for the rest),
 * reading paused while replies pile up, closed (the decisions whose reply it had not written whole
 * ended: the router never learned them) and freed once no job holds it. The one write made
 * off the loop thread: a decided route's reply, by the scheduler thread, when no earlier reply of
 * the connection is still to be written (km_srv_job_hand_back, under write_lock). */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "service/server_internal.h"

static void conn_flush(conn *c);
static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);

/* Reading paused while replies piled up (km_srv_conn_send) starts again once they drained, while
 * the server drains too (what was sent before the stop is answered, a new ROUTE refused). libuv
 * wants the allocation callback again (it refuses NULL with UV_EINVAL); a connection that cannot
 * read is closed. */
static void conn_resume_reading(conn *c)
{
    c->paused = false;
    c->paused_since_ns = 0;
    if (c->frame_started_ns) /* its rest could not come while reading was paused */
        c->frame_started_ns = now_ns();
    int rc = uv_read_start(&c->h.stream, alloc_cb, on_read);
    if (rc < 0) {
        km_srv_log(c->server, KM_LOG_WARNING
                   "closing a connection whose reading could not resume: %s",
                   uv_strerror(rc));
        km_srv_conn_close(c);
    }
}

/* A send buffer (outbox or writing) kept between replies: an empty one larger than this is freed,
 * so an idle connection holds at most this much of each whatever its largest reply was. */
#define SEND_KEEP_BYTES ((size_t)64 << 10)

/* Free send buffer b, counted in st.send_buffer_bytes (write_lock held, or the connection's last
 * reference). */
static void send_buffer_free(km_server *s, km_frame_buffer *b)
{
    atomic_fetch_sub(&s->st.send_buffer_bytes, b->capacity);
    km_frame_buffer_free(b);
}

/* Free b once it is empty and larger than SEND_KEEP_BYTES (write_lock held). */
static void send_buffer_trim(km_server *s, km_frame_buffer *b)
{
    if (b->size == 0 && b->capacity > SEND_KEEP_BYTES)
        send_buffer_free(s, b);
}

/* Free a connection once its handle is closed and no job refers to it (loop thread). */
void km_srv_conn_maybe_free(conn *c)
{
    if (!c->handle_closed || c->jobs_in_flight)
        return;
    km_frame_reader_destroy(c->reader);
    km_protocol_decoder_destroy(c->decoder);
    send_buffer_free(c->server, &c->outbox);
    send_buffer_free(c->server, &c->writing);
    free(c->pending);
    pthread_mutex_destroy(&c->write_lock);
    free(c);
}

/* ---- decisions whose reply is queued ------------------------------------------------------- */

/* Of queued_total, the bytes the socket has taken: all but the outbox and what the uv_write in
 * flight has not written yet (the stream's write_queue_size: one write at a time). write_lock
 * held. */
static uint64_t queued_written(const conn *c)
{
    size_t left = c->outbox.size + (c->write_in_flight ? c->h.stream.write_queue_size : 0);
    return c->queued_total - left;
}

/* Forget the decisions whose reply the socket has taken whole: the router's now. */
static void pending_trim(conn *c)
{
    uint64_t written = queued_written(c);
    while (c->pending_head < c->n_pending && c->pending[c->pending_head].end <= written)
        c->pending_head++;
    if (c->pending_head == c->n_pending)
        c->pending_head = c->n_pending = 0;
}

/* Keep the decisions of job j, whose reply ends at `end` of queued_total, in order of `end`.
 * Without memory they are not kept: should the connection close before their reply is written,
 * their active work ends at its TTL, as if delivered. write_lock held. */
static void pending_add(conn *c, const job *j, uint64_t end)
{
    size_t k = 0;
    for (uint32_t i = 0; j->decisions && i < j->n_routes; i++)
        k += (j->routes[i].status == KM_OK && j->decisions[i].decision_id) +
             (j->routes[i].status == KM_OK && j->decisions[i].has_warm_up);
    if (k == 0 || j->decisions_lost)
        return;
    if (c->n_pending + k > c->pending_cap && c->pending_head > 0) {
        memmove(c->pending, c->pending + c->pending_head,
                (c->n_pending - c->pending_head) * sizeof *c->pending);
        c->n_pending -= c->pending_head;
        c->pending_head = 0;
    }
    if (c->n_pending + k > c->pending_cap) {
        size_t cap = c->pending_cap ? 2 * c->pending_cap : 64;
        while (cap < c->n_pending + k)
            cap *= 2;
        pending_decision *g = realloc(c->pending, cap * sizeof *g);
        if (!g)
            return;
        c->pending = g;
        c->pending_cap = cap;
    }
    size_t at = c->n_pending; /* after every entry ending sooner: the tail, but for a cut reply */
    while (at > c->pending_head && c->pending[at - 1].end > end)
        at--;
    memmove(c->pending + at + k, c->pending + at, (c->n_pending - at) * sizeof *c->pending);
    for (uint32_t i = 0; i < j->n_routes; i++) {
        if (j->routes[i].status == KM_OK && j->decisions[i].decision_id)
            c->pending[at++] = (pending_decision){end, j->decisions[i].decision_id};
        if (j->routes[i].status == KM_OK && j->decisions[i].has_warm_up)
            c->pending[at++] = (pending_decision){end, j->decisions[i].warm_up_decision_id};
    }
    c->n_pending += k;
}

/* A closed connection's decisions whose reply the socket had not taken whole: the router never
 * learned them (km_srv_end_undelivered). Loop thread, the handle closed, holding no lock. */
static void end_unwritten(conn *c)
{
    for (size_t i = c->pending_head; i < c->n_pending; i++)
        if (c->pending[i].end > c->written_at_close)
            km_srv_end_undelivered(c->server, c->pending[i].decision_id);
    free(c->pending);
    c->pending = NULL;
    c->pending_head = c->n_pending = c->pending_cap = 0;
}

/* A closed connection's frames still queued are dropped: deciding them would begin active work,
 * write decision records and tell the cluster, for replies nobody can read. Frames the scheduler
 * role already took are decided, and their decisions ended when delivered (km_srv_deliver_jobs).
 * Loop thread, holding no lock (queue_lock is taken here). */
static void drop_queued_jobs(conn *c)
{
    km_server *s = c->server;
    job *dropped = NULL;
    pthread_mutex_lock(&s->queue_lock);
    job *prev = NULL;
    for (job **link = &s->queue_head; *link;) {
        job *j = *link;
        if (j->conn != c) {
            prev = j;
            link = &j->next;
            continue;
        }
        *link = j->next;
        if (j == s->queue_tail)
            s->queue_tail = prev;
        if (j == s->queue_light_tail) /* the light frames lead the queue: prev is one, or none */
            s->queue_light_tail = prev;
        if (j->behind)
            c->queued_behind--;
        if (j->n_routes > s->inline_routes)
            s->queued_big_frames--;
        s->queued_routes -= j->n_routes;
        j->next = dropped;
        dropped = j;
    }
    pthread_mutex_unlock(&s->queue_lock);
    uint64_t routes = 0;
    while (dropped) {
        job *j = dropped;
        dropped = j->next;
        c->jobs_in_flight--;
        c->routes_in_flight -= j->n_routes;
        routes += j->n_routes;
        km_srv_job_free(j);
    }
    if (routes) {
        atomic_fetch_add(&s->st.dropped_closed, routes);
        km_counter_add(s->m_dropped_closed, routes);
    }
}

static void on_conn_closed(uv_handle_t *h)
{
    conn *c = h->data;
    c->handle_closed = true;
    if (c->jobs_in_flight)
        drop_queued_jobs(c);
    end_unwritten(c);
    km_srv_conn_maybe_free(c);
}

/* Start closing a connection (idempotent), `written` of its queued_total taken by the socket: it
 * leaves the server's list at once; when the handle has closed, its frames still queued are
 * dropped unanswered (drop_queued_jobs), the decisions whose reply was not written whole end
 * (end_unwritten), and its memory goes once its last job being decided was delivered
 * (km_srv_conn_maybe_free). */
static void conn_close_written(conn *c, uint64_t written)
{
    if (c->closing)
        return;
    km_server *s = c->server;
    pthread_mutex_lock(&c->write_lock);
    c->closing = true;
    c->written_at_close = written;
    uv_close(&c->h.handle, on_conn_closed); /* closes the socket: no write may follow */
    pthread_mutex_unlock(&c->write_lock);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    atomic_fetch_sub(&s->st.open, 1);
}

/* conn_close_written with what the socket has taken so far. */
void km_srv_conn_close(conn *c)
{
    pthread_mutex_lock(&c->write_lock);
    uint64_t written = queued_written(c);
    pthread_mutex_unlock(&c->write_lock);
    conn_close_written(c, written);
}

/* Close after a write that failed: none of what it was given counts as taken (a peer gone has
 * none of it either). write_lock held. */
static void conn_close_write_failed(conn *c)
{
    conn_close_written(c, c->queued_total - c->outbox.size - c->write_left);
}

/* A connection whose peer is done (EOF) closes once every reply it is owed is written. */
void km_srv_conn_close_if_finished(conn *c)
{
    if (c->eof && !c->closing && !c->jobs_in_flight && !c->write_in_flight && c->outbox.size == 0)
        km_srv_conn_close(c);
}

static void on_write(uv_write_t *req, int status)
{
    conn *c = req->data;
    pthread_mutex_lock(&c->write_lock);
    c->write_in_flight = false;
    c->writing.size = 0;
    send_buffer_trim(c->server, &c->writing);
    if (status < 0) {
        conn_close_write_failed(c);
        pthread_mutex_unlock(&c->write_lock);
        return;
    }
    c->write_left = 0;
    pending_trim(c);
    if (c->closing) {
        pthread_mutex_unlock(&c->write_lock);
        return;
    }
    km_server *s = c->server;
    if (c->paused)
        c->paused_since_ns = now_ns(); /* the client took a reply: stalled counts from here */
    if (c->paused && c->outbox.size < s->cfg.max_outbox_bytes / 8 && !c->eof)
        conn_resume_reading(c);
    conn_flush(c);
    pthread_mutex_unlock(&c->write_lock);
    km_srv_conn_close_if_finished(c);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    conn *c = h->data;
    buf->base = c->rbuf;
    buf->len = sizeof c->rbuf;
}

/* Write what the outbox holds (write_lock held); nothing while a reply the scheduler thread began
 * writing is unfinished (reply_cut): its rest goes first. */
static void conn_flush(conn *c)
{
    if (c->closing || c->write_in_flight || c->outbox.size == 0 || c->reply_cut)
        return;
    /* Try the write now: a reply the socket takes whole needs no write request, no callback and
     * none of the epoll_ctl calls libuv makes when a request completes. Only what is left (the
     * peer's buffer full) goes through uv_write. */
    /* Built field by field: uv_buf_init takes an unsigned length, which an outbox past 4 GiB
     * would wrap, writing the stream short. */
    uv_buf_t now = {.base = (char *)c->outbox.data, .len = c->outbox.size};
    int n = uv_try_write(&c->h.stream, &now, 1);
    if (n < 0 && n != UV_EAGAIN) {
        km_srv_conn_close(c);
        return;
    }
    size_t written = n > 0 ? (size_t)n : 0;
    if (written == c->outbox.size) {
        c->outbox.size = 0;
        send_buffer_trim(c->server, &c->outbox);
        pending_trim(c);
        if (c->paused && !c->eof)
            conn_resume_reading(c);
        return;
    }
    km_frame_buffer t = c->writing;
    c->writing = c->outbox;
    c->outbox = t;
    c->outbox.size = 0;
    send_buffer_trim(c->server, &c->outbox);
    uv_buf_t buf = {.base = (char *)c->writing.data + written, .len = c->writing.size - written};
    c->write_req.data = c;
    c->write_in_flight = true;
    c->write_left = buf.len;
    int rc = uv_write(&c->write_req, &c->h.stream, &buf, 1, on_write);
    if (rc < 0) {
        c->write_in_flight = false;
        conn_close_write_failed(c);
        return;
    }
    pending_trim(c);
}

/* Queue bytes for the peer and write what the socket takes (write_lock held); a reader that lets
 * too much pile up is closed. Only replies already waiting make a reader slow: a reply that finds
 * nothing unwritten is taken whatever its size (up to max_frame_bytes), so a small
 * max_outbox_bytes never cuts off a client that reads promptly. `first`: the rest of a reply the
 * scheduler thread began in the socket, which goes before everything queued since (nothing of
 * which can have been written: reply_cut holds it back). j: the job whose reply these bytes end
 * (NULL for other frames); its decisions are kept until the reply is written (pending_add).
 * False when the bytes were not queued: the connection is closing, or closed here. */
static bool conn_send_locked(conn *c, const uint8_t *data, size_t size, bool first, const job *j)
{
    km_server *s = c->server;
    if (c->closing)
        return false;
    if (size == 0)
        return true;
    size_t waiting = c->outbox.size + c->writing.size;
    if (waiting > 0 && waiting + size > s->cfg.max_outbox_bytes) {
        atomic_fetch_add(&s->st.slow_closed, 1);
        km_counter_add(s->m_slow_closed, 1);
        km_srv_log(s, KM_LOG_WARNING
                   "closing a connection that does not read its replies (%zu bytes waiting)",
                   c->outbox.size + c->writing.size);
        km_srv_conn_close(c);
        return false;
    }
    if (c->outbox.capacity < c->outbox.size + size) {
        size_t cap = c->outbox.capacity ? c->outbox.capacity : 4096;
        while (cap < c->outbox.size + size)
            cap *= 2;
        uint8_t *g = realloc(c->outbox.data, cap);
        if (!g) {
            km_srv_conn_close(c);
            return false;
        }
        atomic_fetch_add(&s->st.send_buffer_bytes, cap - c->outbox.capacity);
        c->outbox.data = g;
        c->outbox.capacity = cap;
    }
    /* Where the outbox begins in queued_total; what it holds moves back by `size` when these
     * bytes go before it, and so do the ends of its replies. */
    uint64_t outbox_start = c->queued_total - c->outbox.size;
    if (first) {
        memmove(c->outbox.data + size, c->outbox.data, c->outbox.size);
        for (size_t i = c->pending_head; i < c->n_pending; i++)
            if (c->pending[i].end > outbox_start)
                c->pending[i].end += size;
    }
    memcpy(c->outbox.data + (first ? 0 : c->outbox.size), data, size);
    c->outbox.size += size;
    c->queued_total += size;
    if (j)
        pending_add(c, j, first ? outbox_start + size : c->queued_total);
    if (!c->paused && c->reading && c->outbox.size + c->writing.size > s->cfg.max_outbox_bytes / 4) {
        c->paused = true;
        c->paused_since_ns = now_ns();
        atomic_fetch_add(&s->st.reading_paused, 1);
        km_counter_add(s->m_reading_paused, 1);
        uv_read_stop(&c->h.stream);
    }
    conn_flush(c);
    return true;
}

/* Queue frames for the peer (loop thread): conn_send_locked. */
void km_srv_conn_send(conn *c, const km_frame_buffer *frames)
{
    pthread_mutex_lock(&c->write_lock);
    conn_send_locked(c, frames->data, frames->size, false, NULL);
    pthread_mutex_unlock(&c->write_lock);
}

/* A finished job's reply (loop thread, km_srv_deliver_jobs, in the order the jobs were handed
 * back): what the scheduler thread did not write itself is queued, and the job no longer holds
 * back the connection's next replies. False when its rest could not be queued (the connection
 * closed): the router never gets the reply. */
bool km_srv_conn_send_reply(conn *c, job *j)
{
    pthread_mutex_lock(&c->write_lock);
    bool cut = j->reply_written > 0 && j->reply_written < j->reply.size;
    if (cut)
        c->reply_cut = false; /* its rest goes first (conn_send_locked) */
    bool queued = true;
    if (j->reply_written < j->reply.size)
        queued = conn_send_locked(c, j->reply.data + j->reply_written,
                                  j->reply.size - j->reply_written, cut, j);
    if (j->owed) {
        j->owed = false;
        c->replies_owed--;
    }
    pthread_mutex_unlock(&c->write_lock);
    return queued;
}

/* A decided job going back to the loop thread (scheduler role, before it joins the done list).
 * write_now (its reply encoded): the reply goes into the socket at once when nothing of the
 * connection is ahead of it: no earlier job's reply still to be queued (replies_owed), nothing
 * queued or being written. Otherwise, and for what the socket does not take, the job is owed:
 * the loop thread sends the rest when it delivers the job, and later replies of the connection
 * wait for that, so replies leave in the order the jobs were handed back. A socket error leaves
 * the reply to the loop thread too, whose write then fails and closes the connection. */
void km_srv_job_hand_back(job *j, bool write_now)
{
    conn *c = j->conn;
    pthread_mutex_lock(&c->write_lock);
    if (write_now && c->fd >= 0 && !c->closing && c->replies_owed == 0 && !c->write_in_flight &&
        c->outbox.size == 0 && c->writing.size == 0) {
        while (j->reply_written < j->reply.size) {
            ssize_t n = send(c->fd, j->reply.data + j->reply_written,
                             j->reply.size - j->reply_written, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0)
                j->reply_written += (size_t)n;
            else if (n < 0 && errno == EINTR)
                continue;
            else
                break;
        }
    }
    bool written = j->reply.size > 0 && j->reply_written == j->reply.size;
    if (j->reply_written > 0 && !written)
        c->reply_cut = true; /* the socket holds part of a frame: nothing else until its rest */
    if (!written) {
        j->owed = true;
        c->replies_owed++;
    }
    pthread_mutex_unlock(&c->write_lock);
    if (written) {
        KM_SRV_STAGE(j, written);
        atomic_fetch_add(&c->server->st.scheduler_replies, 1);
    }
}

/* Queue an ERROR reply (message id, status code, formatted text) for the peer. */
void km_srv_send_error(conn *c, uint64_t id, int code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    km_frame_buffer fb;
    km_frame_buffer_init(&fb);
    if (km_protocol_encode_error(id, code, msg, &fb) == KM_OK)
        km_srv_conn_send(c, &fb);
    km_frame_buffer_free(&fb);
}

/* An ACK too large for max_frame_bytes with its failed items' messages whole, encoded into fb
 * with every item's status and each failed item's message cut to an equal share of the room the
 * statuses leave (at the least empty). Its items were applied or refused one by one before the
 * reply was built, so only a reply that says which lets the caller go on: an ERROR in its place
 * would leave applied items looking refused, and their retry would meet duplicates. The encoder's
 * error when even empty messages do not fit. */
static int encode_ack_cut(const km_message *m, uint32_t max_frame_bytes, km_frame_buffer *fb,
                          char *why, size_t why_size)
{
    uint32_t n = m->ack.n_items, failed = 0;
    for (uint32_t i = 0; i < n; i++)
        failed += m->ack.items[i].status != KM_OK;
    if (failed == 0)
        return km_protocol_encode(m, max_frame_bytes, fb, why, why_size);
    km_item_status *items = malloc(n * sizeof *items);
    if (!items) {
        snprintf(why, why_size, "out of memory cutting the ACK's messages to fit");
        return KM_ERR_OUT_OF_MEMORY;
    }
    for (uint32_t i = 0; i < n; i++)
        items[i] = (km_item_status){m->ack.items[i].status,
                                    m->ack.items[i].status != KM_OK ? "" : NULL};
    km_message cut = *m;
    cut.ack.items = items;
    int rc = km_protocol_encode(&cut, max_frame_bytes, fb, why, why_size);
    char *texts = NULL;
    if (rc == KM_OK) {
        /* fb holds the ACK with empty messages: its 4-byte length prefix and payload. A message
         * of up to 65,535 bytes takes at most 2 header bytes more than an empty one. */
        size_t room = (size_t)max_frame_bytes - (fb->size - 4);
        size_t share = room / failed > 2 ? room / failed - 2 : 0;
        texts = share ? malloc((size_t)failed * (share + 1)) : NULL;
        for (uint32_t i = 0, k = 0; texts && i < n; i++) {
            if (items[i].status == KM_OK)
                continue;
            const char *whole = m->ack.items[i].message ? m->ack.items[i].message
                                                        : km_strerror(items[i].status);
            char *t = texts + (size_t)k++ * (share + 1);
            size_t len = strnlen(whole, share);
            memcpy(t, whole, len); /* a character cut in two is left out by the encoder */
            t[len] = '\0';
            items[i].message = t;
        }
        if (texts) {
            km_frame_buffer longer;
            km_frame_buffer_init(&longer);
            if (km_protocol_encode(&cut, max_frame_bytes, &longer, NULL, 0) == KM_OK) {
                km_frame_buffer_free(fb);
                *fb = longer;
            } else {
                km_frame_buffer_free(&longer);
            }
        }
    }
    free(texts);
    free(items);
    return rc;
}

/* Encode and queue one reply; one that does not encode within max_frame_bytes is answered with
 * an ERROR naming why, but for an ACK, whose failed items' messages are cut to fit
 * (encode_ack_cut). KM_OK when the reply itself was queued: KM_ERR_CLOSED when the connection is
 * closing, else the encoder's error. */
int km_srv_send_message(conn *c, const km_message *m)
{
    km_frame_buffer fb;
    km_frame_buffer_init(&fb);
    char why[256];
    uint32_t max_frame_bytes = c->server->cfg.limits.max_frame_bytes;
    int rc = km_protocol_encode(m, max_frame_bytes, &fb, why, sizeof why);
    if (rc == KM_ERR_TOO_LARGE && m->type == KM_MESSAGE_ACK) {
        rc = encode_ack_cut(m, max_frame_bytes, &fb, why, sizeof why);
        if (rc == KM_OK)
            atomic_fetch_add(&c->server->st.replies_cut, 1);
    }
    if (rc == KM_OK) {
        pthread_mutex_lock(&c->write_lock);
        if (!conn_send_locked(c, fb.data, fb.size, false, NULL))
            rc = KM_ERR_CLOSED;
        pthread_mutex_unlock(&c->write_lock);
    } else {
        km_srv_send_error(c, m->id, rc, "encoding the reply failed: %s", why);
    }
    km_frame_buffer_free(&fb);
    return rc;
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = stream->data;
    if (c->closing)
        return;
    if (nread < 0) {
        /* EOF or a reset: answer what is in flight, then close. A partial frame is dropped. */
        uv_read_stop(stream);
        c->reading = false;
        c->eof = true;
        if (nread != UV_EOF)
            km_srv_conn_close(c);
        else
            km_srv_conn_close_if_finished(c);
        return;
    }
#ifdef KM_SRV_STAGE_TRACE
    c->read_ns = now_ns();
#endif
    const uint8_t *data = (const uint8_t *)buf->base;
    size_t left = (size_t)nread;
    while (left > 0 && !c->closing) {
        size_t consumed = 0;
        const uint8_t *payload = NULL;
        size_t psize = 0;
        int rc = km_frame_reader_next(c->reader, data, left, &consumed, &payload, &psize);
        if (rc != KM_OK) {
            km_srv_count_bad_frame(c->server);
            km_srv_send_error(c, 0, rc, "%s", km_frame_reader_last_error(c->reader));
            uv_read_stop(stream);
            c->reading = false;
            c->eof = true; /* no more input: the stream cannot be re-synced */
            km_srv_conn_close_if_finished(c);
            return;
        }
        data += consumed;
        left -= consumed;
        if (!payload)
            continue;
        bool keep = km_srv_handle_frame(c, payload, psize);
        /* Everything a request needs was copied out of the frame: an idle connection keeps
         * neither a large frame's buffer nor its decoded tree. */
        km_protocol_decoder_release(c->decoder);
        km_frame_reader_release(c->reader);
        c->frame_started_ns = 0;
        if (!keep) {
            uv_read_stop(stream);
            c->reading = false;
            c->eof = true;
            km_srv_conn_close_if_finished(c);
            return;
        }
    }
    /* A frame begun here and not completed is timed from this read (km_srv_conns_sweep). */
    if (!c->closing && km_frame_reader_pending(c->reader) > 0 && !c->frame_started_ns)
        c->frame_started_ns = now_ns();
}

/* A paused reader has taken none of its replies for stalled_reader_timeout_ms. Bytes it takes of
 * the write in flight count as taking them, as a finished write does (on_write): a reader that
 * drains a large backlog slowly but steadily is not stalled. */
static bool stalled_reader(km_server *s, conn *c, uint64_t now)
{
    pthread_mutex_lock(&c->write_lock);
    size_t left = c->write_in_flight ? c->h.stream.write_queue_size : 0;
    if (left < c->write_queue_seen)
        c->paused_since_ns = now;
    c->write_queue_seen = left;
    bool stalled = now - c->paused_since_ns > (uint64_t)s->cfg.stalled_reader_timeout_ms * 1000000u;
    pthread_mutex_unlock(&c->write_lock);
    return stalled;
}

void km_srv_conns_sweep(km_server *s, uint64_t now)
{
    if (now - s->conns_swept_ns < UINT64_C(100000000))
        return;
    s->conns_swept_ns = now;
    for (conn *c = s->conns, *next; c; c = next) {
        next = c->next; /* a close unlinks c; the rest of the list stays */
        if (c->closing)
            continue;
        if (c->reading && !c->paused && c->frame_started_ns &&
            now - c->frame_started_ns > (uint64_t)s->cfg.frame_timeout_ms * 1000000u) {
            km_srv_count_bad_frame(s);
            km_srv_send_error(c, 0, KM_ERR_TIMEOUT, "a frame begun over %u ms ago is not "
                              "complete: this connection reads no more", s->cfg.frame_timeout_ms);
            uv_read_stop(&c->h.stream);
            c->reading = false;
            c->eof = true;
            c->frame_started_ns = 0;
            km_srv_conn_close_if_finished(c);
        } else if (c->paused && c->paused_since_ns && stalled_reader(s, c, now)) {
            atomic_fetch_add(&s->st.slow_closed, 1);
            km_counter_add(s->m_slow_closed, 1);
            km_srv_log(s, KM_LOG_WARNING
                       "closing a connection that took none of its replies for %u ms (%zu bytes "
                       "waiting)", s->cfg.stalled_reader_timeout_ms,
                       c->outbox.size + c->writing.size);
            km_srv_conn_close(c);
        }
    }
}

/* Refuse a connection just accepted: an ERROR frame (message id 0) written without waiting (a
 * peer that does not read loses it; the socket buffer of a new connection takes it), counted by
 * reason, logged at most once a second with the count since the last line, then closed. */
static void refuse_connection(km_server *s, conn *c, int code, atomic_uint_fast64_t *counter,
                              const char *why)
{
    atomic_fetch_add(&s->st.refused, 1);
    atomic_fetch_add(counter, 1);
    km_frame_buffer fb;
    km_frame_buffer_init(&fb);
    if (km_protocol_encode_error(0, code, why, &fb) == KM_OK) {
        uv_buf_t b = uv_buf_init((char *)fb.data, (unsigned)fb.size);
        (void)uv_try_write(&c->h.stream, &b, 1);
    }
    km_frame_buffer_free(&fb);
    s->refusals_unlogged++;
    uint64_t now = now_ns();
    if (s->refusal_log_ns == 0 || now - s->refusal_log_ns >= UINT64_C(1000000000)) {
        km_srv_log(s, KM_LOG_WARNING
                   "connection refused: %s (%" PRIu64 " refused since the last such line, %" PRIu64
                   " in all)", why, s->refusals_unlogged, (uint64_t)atomic_load(&s->st.refused));
        s->refusal_log_ns = now;
        s->refusals_unlogged = 0;
    }
    c->closing = true;
    uv_close(&c->h.handle, on_conn_closed);
}

/* A listener's new connection (loop thread): refused (an ERROR frame, then closed) while
 * draining, at max_connections, or without memory for its reader and decoder; else it reads. */
void km_srv_on_connection(uv_stream_t *listener, int status)
{
    km_server *s = listener->data;
    if (status < 0)
        return;
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    pthread_mutexattr_t recursive;
    pthread_mutexattr_init(&recursive);
    pthread_mutexattr_settype(&recursive, PTHREAD_MUTEX_RECURSIVE);
    int lock_rc = pthread_mutex_init(&c->write_lock, &recursive);
    pthread_mutexattr_destroy(&recursive);
    if (lock_rc != 0) {
        free(c);
        return;
    }
    c->server = s;
    bool tcp = listener == (uv_stream_t *)&s->tcp_listener;
    int rc = tcp ? uv_tcp_init(&s->loop, &c->h.tcp) : uv_pipe_init(&s->loop, &c->h.pipe, 0);
    if (rc < 0) {
        pthread_mutex_destroy(&c->write_lock);
        free(c);
        return;
    }
    c->h.handle.data = c;
    if (uv_accept(listener, &c->h.stream) < 0) {
        c->closing = true;
        uv_close(&c->h.handle, on_conn_closed);
        return;
    }
    atomic_fetch_add(&s->st.accepted, 1);
    char why[160];
    if (s->draining) {
        refuse_connection(s, c, KM_ERR_SHUTTING_DOWN, &s->st.refused_draining,
                          "the service is shutting down");
        return;
    }
    if (atomic_load(&s->st.open) >= s->cfg.max_connections) {
        snprintf(why, sizeof why, "max_connections (%u) connections are open", s->cfg.max_connections);
        refuse_connection(s, c, KM_ERR_OVERLOADED, &s->st.refused_limit, why);
        return;
    }
    if (km_frame_reader_create(s->cfg.limits.max_frame_bytes, &c->reader) != KM_OK ||
        km_protocol_decoder_create(&s->cfg.limits, &c->decoder) != KM_OK) {
        refuse_connection(s, c, KM_ERR_OUT_OF_MEMORY, &s->st.refused_memory,
                          "no memory for the connection's reader");
        return;
    }
    if (tcp)
        uv_tcp_nodelay(&c->h.tcp, 1);
    if (uv_fileno(&c->h.handle, &c->fd) != 0)
        c->fd = -1; /* the loop thread alone writes its replies (km_srv_job_hand_back) */
    km_frame_buffer_init(&c->outbox);
    km_frame_buffer_init(&c->writing);
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    atomic_fetch_add(&s->st.open, 1);
    c->reading = true;
    uv_read_start(&c->h.stream, alloc_cb, on_read);
}
