/* SPDX-License-Identifier: Apache-2.0 */
/* The ZMQ transport of the event feed (include/kvmatch/subscriber.h, docs/EVENTS.md).
 *
 * Threads. One I/O thread owns every worker socket and the decoder. Other threads talk to it
 * through an inproc PAIR (`control`): a command is a pointer to a struct on the caller's stack,
 * the thread runs it and answers one byte, so the caller's struct outlives its use. The caller-side
 * socket is serialised by control_lock. The feed and the statistics are shared under `lock`; the
 * I/O thread holds it only while handing one decoded message to the feed (never while blocking on
 * a socket). km_subscriber_flush (one at a time, under flush_lock) takes the queued updates under
 * `lock`, hands them to the index outside it while the I/O thread goes on queuing, and publishes
 * the positions under it again (feed_flush_internal.h). Only that caller touches the index, and
 * it serialises its updates and scoring (include/kvmatch/index.h), so scoring never sees half a
 * batch.
 *
 * Replay requests. A worker has at most one in flight (the feed's rule). Its answers are tagged
 * with that request id. Each request is sent on a DEALER of its own: when a request is cancelled or
 * times out the DEALER is closed and reopened, and a new request after one that was superseded or
 * ended gets a fresh one, so late answers to an old request can never be mistaken for the new
 * one's. */
#include "kvmatch/log.h"
#include "kvmatch/subscriber.h"
#include "events/feed_flush_internal.h"
#include "base/log_level.h"
#include "base/array.h"
#include "base/error_detail.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

/* The control PAIR orders a command's writes before the I/O thread reads them, and the I/O thread's
 * answer before the caller reads it. libzmq is not built with ThreadSanitizer, which therefore
 * cannot see that ordering through its lock-free pipes: under ThreadSanitizer these state it at
 * each send (RELEASE) and receive (ACQUIRE); otherwise they are nothing. */
#if defined(__SANITIZE_THREAD__)
#define SUBSCRIBER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SUBSCRIBER_TSAN 1
#endif
#endif
#ifdef SUBSCRIBER_TSAN
#include <sanitizer/tsan_interface.h>
#define CONTROL_RELEASE(sub) __tsan_release(&(sub)->control_caller)
#define CONTROL_ACQUIRE(sub) __tsan_acquire(&(sub)->control_caller)
#else
#define CONTROL_RELEASE(sub) ((void)(sub))
#define CONTROL_ACQUIRE(sub) ((void)(sub))
#endif

/* Frames kept per message; more means a malformed message (the decoder wants 3 or 4). */
#define MAX_FRAMES 8u /* note_malformed names this number */

typedef struct sworker {
    uint32_t id;
    char endpoint[KM_SUBSCRIBER_ENDPOINT_MAX];
    char replay_endpoint[KM_SUBSCRIBER_ENDPOINT_MAX];
    bool has_replay;
    void *sub;
    void *dealer;
    bool dealer_used;   /* a request was sent on this DEALER: the next one needs a fresh one */
    uint64_t replay_id; /* in flight, 0 = none */
    uint64_t deadline_ns;
} sworker;

typedef enum command_kind {
    COMMAND_ADD = 1,
    COMMAND_REMOVE,
    COMMAND_RESYNC,
    COMMAND_STOP,
    COMMAND_CHECK,
} command_kind;

typedef struct command {
    command_kind kind;
    const km_subscriber_worker *worker; /* ADD, CHECK */
    uint32_t id;                        /* REMOVE, RESYNC */
    int status;                         /* the answer */
    char error[256];
} command;

struct km_subscriber {
    km_subscriber_config config;
    void *ctx;
    void *control_io;     /* I/O thread's end */
    void *control_caller; /* callers' end, under control_lock */
    pthread_mutex_t control_lock;
    pthread_t thread;
    bool thread_started;

    pthread_mutex_t lock; /* feed, stats, last_error */
    /* One flush at a time. A flush applies the index outside `lock` (km_feed_flush_apply), so
     * the I/O thread decodes and queues the next messages meanwhile; whatever needs the index
     * settled under `lock` (a save) waits on flush_done while km_feed_flush_in_flight. Order:
     * flush_lock, then lock. */
    pthread_mutex_t flush_lock;
    pthread_cond_t flush_done;
    km_feed *feed;
    km_subscriber_stats stats;
    char last_error[256];
    char snapshot_path[4096];
    uint64_t last_snapshot_ns;
    pid_t snapshot_child; /* background snapshot being written; 0 = none */
    int snapshot_pipe;    /* its error text, read when reaped; -1 = none */
    uint32_t saves_waiting; /* km_subscriber_save calls waiting for snapshot_child: fork no other */
    /* A snapshot that failed to restore, still at its path: moved aside before the first save
     * that would overwrite it (keep_unrestorable). "" = none. */
    char unrestorable[4096];

    /* I/O thread only */
    km_kv_decoder *decoder;
    sworker **workers;
    size_t n_workers, workers_capacity;
    zmq_pollitem_t *items;
    sworker **item_worker; /* per item (NULL for control) */
    bool *item_is_replay;
    size_t n_items, items_capacity;
    bool items_dirty;
    bool stopping;
};

/* ---- helpers -------------------------------------------------------------------------------- */

static void sub_log(const km_subscriber *sub, const char *fmt, ...)
{
    char line[512];
    size_t level = km_log_level_length(fmt);
    int n = snprintf(line, sizeof line, "%.*ssubscriber: ", (int)level, fmt);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt + level, ap);
    va_end(ap);
    if (sub->config.log)
        sub->config.log(sub->config.log_user, line);
    else
        fprintf(stderr, "kvmatch: %s\n", line + level);
}

static int set_error(km_subscriber *sub, int status, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(msg, sizeof msg, status, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&sub->lock);
    memcpy(sub->last_error, msg, sizeof msg);
    pthread_mutex_unlock(&sub->lock);
    return status;
}

const char *km_subscriber_last_error(const km_subscriber *sub)
{
    /* Another thread's failing call may be writing last_error: the reader gets a copy of its own,
     * taken under the lock. */
    static _Thread_local char copy[sizeof sub->last_error];
    if (!sub)
        return "";
    km_subscriber *mut = (km_subscriber *)sub; /* the lock only */
    pthread_mutex_lock(&mut->lock);
    memcpy(copy, sub->last_error, sizeof copy);
    pthread_mutex_unlock(&mut->lock);
    return copy;
}

static uint64_t read_be64(const void *p)
{
    const unsigned char *b = p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | b[i];
    return v;
}

static void write_be64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (56 - 8 * i));
}

void km_subscriber_config_init(km_subscriber_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    km_feed_config_init(&cfg->feed);
    km_kv_decoder_config_init(&cfg->decoder);
    cfg->replay_timeout_ms = 5000;
    cfg->receive_hwm = 100000;
    cfg->max_messages_per_wakeup = 256;
    cfg->snapshot_path = NULL;
    cfg->snapshot_interval_ms = 0;
    cfg->restore_path = NULL;
}

/* ---- endpoints ------------------------------------------------------------------------------ */

int km_endpoint_for_rank(const char *endpoint, uint32_t rank, char *out, size_t out_size)
{
    if (!endpoint || !out)
        return KM_ERR_NULL_POINTER;
    int n;
    if (rank == 0) {
        n = snprintf(out, out_size, "%s", endpoint);
    } else if (strncmp(endpoint, "tcp://", 6) == 0) {
        const char *colon = strrchr(endpoint + 6, ':');
        if (!colon || colon[1] == '\0')
            return KM_ERR_INVALID_ARGUMENT;
        uint64_t port = 0;
        for (const char *p = colon + 1; *p; p++) {
            if (*p < '0' || *p > '9' || port > 65535)
                return KM_ERR_INVALID_ARGUMENT;
            port = port * 10 + (uint64_t)(*p - '0');
        }
        if (port + rank > 65535)
            return KM_ERR_INVALID_ARGUMENT;
        n = snprintf(out, out_size, "%.*s:%" PRIu64, (int)(colon - endpoint), endpoint,
                     port + rank);
    } else if (strncmp(endpoint, "inproc://", 9) == 0) {
        n = snprintf(out, out_size, "%s_dp%u", endpoint, rank);
    } else {
        return KM_ERR_INVALID_ARGUMENT;
    }
    if (n < 0 || (size_t)n >= out_size)
        return KM_ERR_TOO_LARGE;
    return KM_OK;
}

/* ---- sockets -------------------------------------------------------------------------------- */

static void close_socket(void **s)
{
    if (*s) {
        zmq_close(*s);
        *s = NULL;
    }
}

static void *open_socket(km_subscriber *sub, int type, const char *endpoint, char *err,
                         size_t err_size)
{
    void *s = zmq_socket(sub->ctx, type);
    if (!s) {
        snprintf(err, err_size, "zmq_socket: %s", zmq_strerror(errno));
        return NULL;
    }
    int zero = 0;
    int64_t max_size = sub->config.decoder.max_payload_bytes > INT64_MAX
                           ? -1
                           : (int64_t)sub->config.decoder.max_payload_bytes;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &max_size, sizeof max_size);
    /* Both sockets take what arrives off the wire at once, up to receive_hwm messages: the
     * publisher's PUB drops past its own high-water mark, and its replay ROUTER, which writes a
     * whole replay (up to its buffer_steps, 10,000 by default) in one tight loop, silently drops
     * whatever its peer pipe (SNDHWM 1000) cannot take. With libzmq's default of 1000 queued here
     * a replay answered while this thread is held up (a flush or snapshot holding the lock, a
     * burst on other sockets) would lose its middle (asked for again by the feed, one more round
     * each time) or its end marker (a timeout, and what it had not given lost). */
    int hwm = sub->config.receive_hwm;
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
    if (type == ZMQ_SUB)
        zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(s, endpoint) != 0) {
        snprintf(err, err_size, "connect %s: %s", endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* Drop the DEALER and any answers queued on it; a fresh one is connected. */
static void reopen_dealer(km_subscriber *sub, sworker *w)
{
    close_socket(&w->dealer);
    char err[256];
    w->dealer = open_socket(sub, ZMQ_DEALER, w->replay_endpoint, err, sizeof err);
    if (!w->dealer)
        sub_log(sub, KM_LOG_WARNING "worker %u: replay socket: %s", w->id, err);
    w->dealer_used = false;
    w->replay_id = 0;
    sub->items_dirty = true;
}

static void worker_close(sworker *w)
{
    close_socket(&w->sub);
    close_socket(&w->dealer);
    free(w);
}

static sworker *find_sworker(const km_subscriber *sub, uint32_t id, size_t *index)
{
    for (size_t i = 0; i < sub->n_workers; i++)
        if (sub->workers[i]->id == id) {
            if (index)
                *index = i;
            return sub->workers[i];
        }
    return NULL;
}

static int rebuild_items(km_subscriber *sub)
{
    /* Three parallel arrays of one capacity: each grows from it to twice what is needed now, and
     * the capacity moves only once all three have. */
    size_t need = 1 + 2 * sub->n_workers;
    size_t cap_items = sub->items_capacity, cap_worker = cap_items, cap_replay = cap_items;
    if (KM_ARRAY_GROW(sub->items, cap_items, need, 2 * need) ||
        KM_ARRAY_GROW(sub->item_worker, cap_worker, need, 2 * need) ||
        KM_ARRAY_GROW(sub->item_is_replay, cap_replay, need, 2 * need))
        return KM_ERR_OUT_OF_MEMORY;
    sub->items_capacity = cap_items;
    size_t n = 0;
    sub->items[n] = (zmq_pollitem_t){sub->control_io, 0, ZMQ_POLLIN, 0};
    sub->item_worker[n] = NULL;
    sub->item_is_replay[n++] = false;
    for (size_t i = 0; i < sub->n_workers; i++) {
        sworker *w = sub->workers[i];
        if (w->sub) {
            sub->items[n] = (zmq_pollitem_t){w->sub, 0, ZMQ_POLLIN, 0};
            sub->item_worker[n] = w;
            sub->item_is_replay[n++] = false;
        }
        if (w->dealer) {
            sub->items[n] = (zmq_pollitem_t){w->dealer, 0, ZMQ_POLLIN, 0};
            sub->item_worker[n] = w;
            sub->item_is_replay[n++] = true;
        }
    }
    sub->n_items = n;
    sub->items_dirty = false;
    return KM_OK;
}

/* ---- actions: what the feed asks the transport to do ------------------------------------------ */

static void run_actions(km_subscriber *sub, uint64_t now)
{
    for (;;) {
        km_feed_action actions[32];
        size_t n = 0;
        pthread_mutex_lock(&sub->lock);
        while (n < 32 && km_feed_next_action(sub->feed, &actions[n]))
            n++;
        pthread_mutex_unlock(&sub->lock);
        if (n == 0)
            return;
        for (size_t i = 0; i < n; i++) {
            const km_feed_action *a = &actions[i];
            sworker *w = find_sworker(sub, a->worker, NULL);
            if (!w)
                continue; /* removed meanwhile */
            if (a->kind == KM_FEED_ACTION_REPLAY_CANCEL) {
                if (w->replay_id == a->request_id)
                    reopen_dealer(sub, w);
                continue;
            }
            /* Every request gets a DEALER of its own: one superseded, and equally one that ended
             * (a publisher may answer twice, or send past its end marker), can never have its
             * answers taken for this one's. */
            if (w->replay_id || w->dealer_used)
                reopen_dealer(sub, w);
            bool sent = false;
            if (w->dealer) {
                unsigned char start[8];
                write_be64(start, a->start_seq);
                /* [empty delimiter, start]: the publisher's ROUTER reads [identity, "", start]. */
                sent = zmq_send(w->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) == 0 &&
                       zmq_send(w->dealer, start, 8, ZMQ_DONTWAIT) == 8;
            }
            pthread_mutex_lock(&sub->lock);
            if (sent) {
                w->dealer_used = true;
                w->replay_id = a->request_id;
                w->deadline_ns = now + (uint64_t)sub->config.replay_timeout_ms * 1000000u;
                sub->stats.replay_requests++;
            } else {
                sub->stats.replay_send_failures++;
                km_feed_replay_failed(sub->feed, w->id, a->request_id, KM_FEED_REPLAY_UNREACHABLE,
                                      now);
            }
            pthread_mutex_unlock(&sub->lock);
            if (!sent && w->has_replay)
                reopen_dealer(sub, w); /* a half-sent request must not linger */
        }
    }
}

/* ---- receiving -------------------------------------------------------------------------------- */

typedef struct received {
    zmq_msg_t parts[MAX_FRAMES];
    km_kv_frame frames[MAX_FRAMES];
    size_t n;
    bool too_many;
    size_t bytes;
} received;

static void received_close(received *r)
{
    for (size_t i = 0; i < r->n; i++)
        zmq_msg_close(&r->parts[i]);
    r->n = 0;
}

/* One whole multipart message without blocking: 1 received, 0 none waiting. */
static int receive_message(void *socket, received *r)
{
    r->n = 0;
    r->too_many = false;
    r->bytes = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, socket, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return r->n > 0 || r->too_many; /* parts of one message arrive together */
        }
        int more = zmq_msg_more(&m);
        r->bytes += zmq_msg_size(&m);
        if (r->n < MAX_FRAMES) {
            r->parts[r->n] = m;
            r->frames[r->n].data = zmq_msg_data(&r->parts[r->n]);
            r->frames[r->n].size = zmq_msg_size(&r->parts[r->n]);
            r->n++;
        } else {
            zmq_msg_close(&m);
            r->too_many = true;
        }
        if (!more)
            return 1;
    }
}

/* Why a message did not decode, as the decoder says (frame, event, field or limit), kept as the
 * subscriber's latest malformed message (lock held). */
static const char *note_malformed(km_subscriber *sub, const sworker *w, const received *r,
                                  const char *socket)
{
    const char *why = r->too_many ? "KM_ERR_PARSE: more than 8 frames"
                                  : km_kv_decoder_last_error(sub->decoder);
    sub->stats.malformed++;
    char seq[32] = ""; /* the engine's seq of the message, where its seq frame reads */
    if (!r->too_many && r->n == 3 && r->frames[1].size == 8)
        snprintf(seq, sizeof seq, ", seq %" PRIu64, read_be64(r->frames[1].data));
    snprintf(sub->stats.last_malformed, sizeof sub->stats.last_malformed, "worker %u, %s%s: %s",
             w->id, socket, seq, why);
    return why;
}

static void handle_live(km_subscriber *sub, sworker *w, received *r, uint64_t now)
{
    km_kv_message msg;
    int rc = r->too_many ? KM_ERR_PARSE
                         : km_kv_decode_message(sub->decoder, KM_KV_SOURCE_SUBSCRIBER, r->frames,
                                                r->n, &msg);
    pthread_mutex_lock(&sub->lock);
    km_kv_decoder_get_stats(sub->decoder, &sub->stats.decoder); /* the decoder is this thread's */
    sub->stats.live_messages++;
    sub->stats.bytes_received += r->bytes;
    if (rc == KM_OK) {
        km_feed_live(sub->feed, w->id, msg.seq, &msg.batch, now);
    } else {
        const char *why = note_malformed(sub, w, r, "live");
        /* A readable seq goes to the feed, which consumes it only where the next live message
         * belongs (km_feed_live): frames that did not decode may carry any seq. */
        if (!r->too_many && r->n == 3 && r->frames[1].size == 8)
            km_feed_live_undecodable(sub->feed, w->id, read_be64(r->frames[1].data), why, now);
        else
            km_feed_malformed(sub->feed, w->id, KM_KV_SOURCE_SUBSCRIBER, why, now);
    }
    pthread_mutex_unlock(&sub->lock);
}

static void handle_replay(km_subscriber *sub, sworker *w, received *r, uint64_t now)
{
    km_kv_message msg;
    int rc = r->too_many ? KM_ERR_PARSE
                         : km_kv_decode_message(sub->decoder, KM_KV_SOURCE_REPLAY, r->frames, r->n,
                                                &msg);
    uint64_t request = w->replay_id;
    bool ended = false;
    pthread_mutex_lock(&sub->lock);
    km_feed_worker_info before, after;
    bool known = km_feed_get_worker_info(sub->feed, w->id, &before) == KM_OK;
    km_kv_decoder_get_stats(sub->decoder, &sub->stats.decoder);
    sub->stats.replay_messages++;
    sub->stats.bytes_received += r->bytes;
    if (rc == KM_OK) {
        if (msg.kind == KM_KV_MESSAGE_REPLAY_END) {
            km_feed_replay_end(sub->feed, w->id, request, now);
            ended = true;
        } else {
            km_feed_replay_item(sub->feed, w->id, request, msg.seq, &msg.batch, now);
        }
    } else {
        const char *why = note_malformed(sub, w, r, "replay");
        bool seq_readable = !r->too_many && (r->n == 3 || r->n == 4) && r->frames[0].size == 0 &&
                            r->frames[r->n - 2].size == 8;
        uint64_t seq = seq_readable ? read_be64(r->frames[r->n - 2].data) : 0;
        if (seq_readable && seq == KM_KV_REPLAY_END_SEQ) {
            km_feed_malformed(sub->feed, w->id, KM_KV_SOURCE_REPLAY, why, now);
            km_feed_replay_end(sub->feed, w->id, request, now); /* an end marker all the same */
            ended = true;
        } else if (seq_readable) {
            /* The feed consumes it only as the next seq to apply (km_feed_replay_item). */
            km_feed_replay_item_undecodable(sub->feed, w->id, request, seq, why, now);
        } else {
            km_feed_malformed(sub->feed, w->id, KM_KV_SOURCE_REPLAY, why, now);
        }
    }
    /* Only an answer that moved the stream (an item applied or consumed, history found lost, the
     * state changed) earns the request more time: refused, stale or unreadable items do not, so an
     * endpoint that keeps sending them without an end marker times out like a silent one instead
     * of keeping the worker in GAP for good. */
    bool progress = !known || km_feed_get_worker_info(sub->feed, w->id, &after) != KM_OK ||
                    after.expected_seq != before.expected_seq ||
                    after.has_expected_seq != before.has_expected_seq || after.state != before.state;
    pthread_mutex_unlock(&sub->lock);
    if (ended)
        w->replay_id = 0;
    else if (w->replay_id && progress)
        w->deadline_ns = now + (uint64_t)sub->config.replay_timeout_ms * 1000000u;
}

/* ---- commands ----------------------------------------------------------------------------------- */

static void command_add(km_subscriber *sub, command *c, uint64_t now)
{
    const km_subscriber_worker *cfg = c->worker;
    if (find_sworker(sub, cfg->worker, NULL)) {
        c->status = KM_ERR_INVALID_ARGUMENT;
        snprintf(c->error, sizeof c->error, "worker %u is already followed", cfg->worker);
        return;
    }
    sworker *w = calloc(1, sizeof *w);
    void *grown = w ? realloc(sub->workers, (sub->n_workers + 1) * sizeof *sub->workers) : NULL;
    if (!w || !grown) {
        free(w);
        c->status = KM_ERR_OUT_OF_MEMORY;
        snprintf(c->error, sizeof c->error, "worker table");
        return;
    }
    sub->workers = grown;
    w->id = cfg->worker;
    snprintf(w->endpoint, sizeof w->endpoint, "%s", cfg->endpoint);
    w->has_replay = cfg->replay_endpoint != NULL;
    if (w->has_replay)
        snprintf(w->replay_endpoint, sizeof w->replay_endpoint, "%s", cfg->replay_endpoint);
    w->sub = open_socket(sub, ZMQ_SUB, w->endpoint, c->error, sizeof c->error);
    if (w->sub && w->has_replay)
        w->dealer = open_socket(sub, ZMQ_DEALER, w->replay_endpoint, c->error, sizeof c->error);
    if (!w->sub || (w->has_replay && !w->dealer)) {
        c->status = KM_ERR_INVALID_ARGUMENT; /* c->error says which socket and why */
        worker_close(w);
        return;
    }
    /* Producer identity kept in snapshots: the endpoints (vLLM has no epoch; a new engine process
     * behind the same endpoints shows as seq going back). */
    char identity[KM_FEED_NAME_MAX];
    snprintf(identity, sizeof identity, "%.120s %.120s", cfg->endpoint,
             cfg->replay_endpoint ? cfg->replay_endpoint : "-");
    km_feed_worker_config fc = {cfg->worker, cfg->name ? cfg->name : cfg->endpoint, w->has_replay};
    pthread_mutex_lock(&sub->lock);
    c->status = km_feed_add_worker_identity(sub->feed, &fc, identity, now);
    if (c->status)
        snprintf(c->error, sizeof c->error, "%s", km_feed_last_error(sub->feed));
    pthread_mutex_unlock(&sub->lock);
    if (c->status) {
        worker_close(w);
        return;
    }
    sub->workers[sub->n_workers++] = w;
    sub->items_dirty = true;
}

/* The sockets command_add would open for cfg, opened and closed at once: what they refuse. */
static void command_check(km_subscriber *sub, command *c)
{
    const km_subscriber_worker *cfg = c->worker;
    void *s = open_socket(sub, ZMQ_SUB, cfg->endpoint, c->error, sizeof c->error);
    void *d = s && cfg->replay_endpoint
                  ? open_socket(sub, ZMQ_DEALER, cfg->replay_endpoint, c->error, sizeof c->error)
                  : NULL;
    if (!s || (cfg->replay_endpoint && !d))
        c->status = KM_ERR_INVALID_ARGUMENT; /* c->error says which socket and why */
    close_socket(&s);
    close_socket(&d);
}

static void command_remove(km_subscriber *sub, command *c, uint64_t now)
{
    size_t i;
    sworker *w = find_sworker(sub, c->id, &i);
    pthread_mutex_lock(&sub->lock);
    if (!w) {
        /* A worker restored from a snapshot and never added again has no sockets: the feed alone
         * knows it. */
        km_feed_worker_info info;
        if (km_feed_get_worker_info(sub->feed, c->id, &info) == KM_OK && info.awaiting_claim) {
            c->status = km_feed_remove_worker(sub->feed, c->id, now);
        } else {
            c->status = KM_ERR_INVALID_ARGUMENT;
            snprintf(c->error, sizeof c->error, "worker %u is not followed", c->id);
        }
        pthread_mutex_unlock(&sub->lock);
        return;
    }
    c->status = km_feed_remove_worker(sub->feed, c->id, now);
    if (c->status)
        snprintf(c->error, sizeof c->error, "%s", km_feed_last_error(sub->feed));
    pthread_mutex_unlock(&sub->lock);
    if (c->status)
        return;
    memmove(sub->workers + i, sub->workers + i + 1, (sub->n_workers - i - 1) * sizeof *sub->workers);
    sub->n_workers--;
    worker_close(w);
    sub->items_dirty = true;
}

static void command_resync(km_subscriber *sub, command *c, uint64_t now)
{
    sworker *w = find_sworker(sub, c->id, NULL);
    if (!w) {
        c->status = KM_ERR_INVALID_ARGUMENT;
        snprintf(c->error, sizeof c->error, "worker %u is not followed", c->id);
        return;
    }
    pthread_mutex_lock(&sub->lock);
    c->status = km_feed_resync_worker(sub->feed, c->id, now);
    if (c->status)
        snprintf(c->error, sizeof c->error, "%s", km_feed_last_error(sub->feed));
    pthread_mutex_unlock(&sub->lock);
}

static void handle_control(km_subscriber *sub, uint64_t now)
{
    command *c;
    while (zmq_recv(sub->control_io, &c, sizeof c, ZMQ_DONTWAIT) == (int)sizeof c) {
        CONTROL_ACQUIRE(sub);
        c->status = KM_OK;
        c->error[0] = '\0';
        switch (c->kind) {
        case COMMAND_ADD: command_add(sub, c, now); break;
        case COMMAND_REMOVE: command_remove(sub, c, now); break;
        case COMMAND_RESYNC: command_resync(sub, c, now); break;
        case COMMAND_STOP: sub->stopping = true; break;
        case COMMAND_CHECK: command_check(sub, c); break;
        }
        char done = 1;
        CONTROL_RELEASE(sub);
        zmq_send(sub->control_io, &done, 1, 0);
        if (sub->stopping)
            return;
    }
}

/* ---- the I/O thread ------------------------------------------------------------------------------- */

/* Has an answer arrived on the DEALER that this thread has not read yet? */
static bool answer_waiting(const sworker *w)
{
    int events = 0;
    size_t size = sizeof events;
    return w->dealer && zmq_getsockopt(w->dealer, ZMQ_EVENTS, &events, &size) == 0 &&
           (events & ZMQ_POLLIN);
}

/* A request fails as a timeout only when nothing of its answer is waiting: the deadline measures
 * the publisher's silence, not this thread's own delays (a flush or snapshot holding the lock, a
 * burst on other sockets, revents from before the answer came). A waiting answer is read at the
 * next poll, which returns at once, and resets the deadline. */
static void check_deadlines(km_subscriber *sub, uint64_t now)
{
    for (size_t i = 0; i < sub->n_workers; i++) {
        sworker *w = sub->workers[i];
        if (!w->replay_id || now < w->deadline_ns || answer_waiting(w))
            continue;
        uint64_t request = w->replay_id;
        sub_log(sub, KM_LOG_WARNING
                "worker %u: replay request %" PRIu64 " timed out", w->id, request);
        reopen_dealer(sub, w);
        pthread_mutex_lock(&sub->lock);
        sub->stats.replay_timeouts++;
        km_feed_replay_failed(sub->feed, w->id, request, KM_FEED_REPLAY_TIMEOUT, now);
        pthread_mutex_unlock(&sub->lock);
    }
}

static long poll_timeout_ms(const km_subscriber *sub, uint64_t now)
{
    uint64_t earliest = UINT64_MAX;
    for (size_t i = 0; i < sub->n_workers; i++)
        if (sub->workers[i]->replay_id && sub->workers[i]->deadline_ns < earliest)
            earliest = sub->workers[i]->deadline_ns;
    if (earliest == UINT64_MAX)
        return -1;
    if (earliest <= now)
        return 0;
    uint64_t ms = (earliest - now + 999999u) / 1000000u;
    return ms > 60000 ? 60000 : (long)ms;
}

static void *io_main(void *arg)
{
    km_subscriber *sub = arg;
    received r;
    while (!sub->stopping) {
        if (sub->items_dirty && rebuild_items(sub) != KM_OK) {
            sub_log(sub, KM_LOG_ERROR "out of memory building the poll set; retrying");
            zmq_poll(NULL, 0, 10);
            continue;
        }
        int rc = zmq_poll(sub->items, (int)sub->n_items, poll_timeout_ms(sub, km_feed_clock_ns()));
        if (rc < 0) {
            if (errno == ETERM)
                break;
            if (errno != EINTR)
                sub_log(sub, KM_LOG_ERROR "zmq_poll: %s", zmq_strerror(errno));
            continue;
        }
        uint64_t now = km_feed_clock_ns();
        pthread_mutex_lock(&sub->lock);
        sub->stats.wakeups++;
        pthread_mutex_unlock(&sub->lock);
        bool control_ready = sub->items[0].revents & ZMQ_POLLIN;
        /* Sockets first: a command may close some of them. */
        for (size_t i = 1; i < sub->n_items && !sub->items_dirty; i++) {
            if (!(sub->items[i].revents & ZMQ_POLLIN))
                continue;
            sworker *w = sub->item_worker[i];
            bool is_replay = sub->item_is_replay[i];
            void *socket = sub->items[i].socket;
            for (uint32_t k = 0; k < sub->config.max_messages_per_wakeup; k++) {
                if (!receive_message(socket, &r))
                    break;
                now = km_feed_clock_ns();
                if (is_replay)
                    handle_replay(sub, w, &r, now);
                else
                    handle_live(sub, w, &r, now);
                received_close(&r);
                run_actions(sub, now);
                if (sub->items_dirty)
                    break; /* a DEALER was reopened: `socket` may be gone */
            }
        }
        /* Something was received: tell the flushing thread (it may be asleep between batches). */
        if (rc > 0 && sub->config.on_received && (rc > 1 || !control_ready))
            sub->config.on_received(sub->config.on_received_user);
        now = km_feed_clock_ns();
        if (control_ready)
            handle_control(sub, now);
        if (sub->stopping)
            break;
        run_actions(sub, now);
        check_deadlines(sub, now);
        run_actions(sub, now);
    }
    return NULL;
}

/* ---- public API ------------------------------------------------------------------------------------- */

int km_subscriber_create(km_index *index, const km_subscriber_config *cfg_in, km_subscriber **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    if (!index)
        return KM_ERR_NULL_POINTER;
    km_subscriber_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        km_subscriber_config_init(&cfg);
    if (cfg.replay_timeout_ms == 0 || cfg.max_messages_per_wakeup == 0 || cfg.receive_hwm < 0)
        return KM_ERR_INVALID_ARGUMENT;
    km_subscriber *sub = calloc(1, sizeof *sub);
    if (!sub)
        return KM_ERR_OUT_OF_MEMORY;
    sub->config = cfg;
    pthread_mutex_init(&sub->lock, NULL);
    pthread_mutex_init(&sub->flush_lock, NULL);
    pthread_cond_init(&sub->flush_done, NULL);
    pthread_mutex_init(&sub->control_lock, NULL);
    int rc = km_feed_create(index, &cfg.feed, &sub->feed);
    if (!rc)
        rc = km_kv_decoder_create(&cfg.decoder, &sub->decoder);
    if (rc) {
        km_subscriber_destroy(sub);
        return rc;
    }
    /* Paths are copied: the caller's strings need not outlive the call. */
    if (cfg.snapshot_path) {
        snprintf(sub->snapshot_path, sizeof sub->snapshot_path, "%s", cfg.snapshot_path);
        sub->config.snapshot_path = sub->snapshot_path;
    }
    sub->config.restore_path = NULL;
    sub->last_snapshot_ns = km_feed_clock_ns();
    sub->snapshot_pipe = -1;
    if (cfg.restore_path) {
        /* Restart of kvmatch: before any socket exists. Failure is not fatal: start empty, and
         * keep the file that did not restore (keep_unrestorable). */
        rc = km_feed_restore(sub->feed, cfg.restore_path, km_feed_clock_ns());
        sub->stats.restore_status = rc;
        if (rc) {
            snprintf(sub->stats.restore_error, sizeof sub->stats.restore_error, "%s",
                     km_feed_last_error(sub->feed));
            struct stat st;
            bool present = stat(cfg.restore_path, &st) == 0;
            if (present)
                snprintf(sub->unrestorable, sizeof sub->unrestorable, "%s", cfg.restore_path);
            sub_log(sub, KM_LOG_ERROR "restore failed, starting empty: %s%s",
                    sub->stats.restore_error,
                    present ? "; the file is kept, moved aside before a snapshot takes its path"
                            : "");
        } else {
            sub->stats.restored = true;
        }
    }
    sub->ctx = zmq_ctx_new();
    if (!sub->ctx) {
        km_subscriber_destroy(sub);
        return KM_ERR_IO;
    }
    char inproc[64];
    snprintf(inproc, sizeof inproc, "inproc://km-subscriber-%p", (void *)sub);
    sub->control_io = zmq_socket(sub->ctx, ZMQ_PAIR);
    sub->control_caller = zmq_socket(sub->ctx, ZMQ_PAIR);
    int zero = 0;
    if (!sub->control_io || !sub->control_caller ||
        zmq_setsockopt(sub->control_io, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(sub->control_caller, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_bind(sub->control_io, inproc) || zmq_connect(sub->control_caller, inproc)) {
        km_subscriber_destroy(sub);
        return KM_ERR_IO;
    }
    sub->items_dirty = true;
    if (pthread_create(&sub->thread, NULL, io_main, sub) != 0) {
        km_subscriber_destroy(sub);
        return KM_ERR_IO;
    }
    pthread_setname_np(sub->thread, "km-subscriber"); /* for top -H, perf, bench ipc */
    sub->thread_started = true;
    *out = sub;
    return KM_OK;
}

/* Run one command on the I/O thread and wait for it. A signal handled on this thread interrupts
 * libzmq's wait (EINTR, whatever SA_RESTART says): the send is tried again, and once it has gone
 * the answer is always awaited, since the I/O thread reads and writes *c until it answers, and an
 * answer left unread would be taken for the next command's. */
static int run_command(km_subscriber *sub, command *c)
{
    pthread_mutex_lock(&sub->control_lock);
    int rc = KM_OK, n;
    command *p = c;
    CONTROL_RELEASE(sub);
    do
        n = zmq_send(sub->control_caller, &p, sizeof p, 0);
    while (n < 0 && errno == EINTR);
    if (n != (int)sizeof p) {
        rc = KM_ERR_IO;
    } else {
        char done;
        do
            n = zmq_recv(sub->control_caller, &done, 1, 0);
        while (n < 0 && errno == EINTR);
        CONTROL_ACQUIRE(sub);
        if (n != 1) /* ETERM only, and the context lives until km_subscriber_destroy */
            rc = KM_ERR_IO;
    }
    pthread_mutex_unlock(&sub->control_lock);
    if (rc)
        return set_error(sub, rc, "control channel: %s", zmq_strerror(errno));
    if (c->status)
        return set_error(sub, c->status, "%s", c->error);
    return KM_OK;
}

static void reap_snapshot_child(km_subscriber *sub, bool wait);

void km_subscriber_destroy(km_subscriber *sub)
{
    if (!sub)
        return;
    if (sub->thread_started) {
        command c = {.kind = COMMAND_STOP};
        run_command(sub, &c);
        pthread_join(sub->thread, NULL);
    }
    for (size_t i = 0; i < sub->n_workers; i++)
        worker_close(sub->workers[i]);
    free(sub->workers);
    free(sub->items);
    free(sub->item_worker);
    free(sub->item_is_replay);
    if (sub->control_io)
        zmq_close(sub->control_io);
    if (sub->control_caller)
        zmq_close(sub->control_caller);
    if (sub->ctx)
        zmq_ctx_term(sub->ctx);
    reap_snapshot_child(sub, true);
    km_kv_decoder_destroy(sub->decoder);
    km_feed_destroy(sub->feed);
    pthread_mutex_destroy(&sub->lock);
    pthread_mutex_destroy(&sub->flush_lock);
    pthread_cond_destroy(&sub->flush_done);
    pthread_mutex_destroy(&sub->control_lock);
    free(sub);
}

static int check_endpoint(km_subscriber *sub, const char *e, const char *what)
{
    if (strlen(e) >= KM_SUBSCRIBER_ENDPOINT_MAX)
        return set_error(sub, KM_ERR_TOO_LARGE, "%s longer than %u bytes", what,
                         KM_SUBSCRIBER_ENDPOINT_MAX - 1);
    return KM_OK;
}

/* A command naming a worker's configuration (ADD or CHECK), its endpoints checked first. */
static int worker_command(km_subscriber *sub, const km_subscriber_worker *worker,
                          command_kind kind)
{
    if (!sub || !worker || !worker->endpoint)
        return KM_ERR_NULL_POINTER;
    int rc = check_endpoint(sub, worker->endpoint, "endpoint");
    if (!rc && worker->replay_endpoint)
        rc = check_endpoint(sub, worker->replay_endpoint, "replay endpoint");
    if (rc)
        return rc;
    command c = {.kind = kind, .worker = worker};
    return run_command(sub, &c);
}

int km_subscriber_add_worker(km_subscriber *sub, const km_subscriber_worker *worker)
{
    return worker_command(sub, worker, COMMAND_ADD);
}

int km_subscriber_check_worker(km_subscriber *sub, const km_subscriber_worker *worker)
{
    return worker_command(sub, worker, COMMAND_CHECK);
}

int km_subscriber_add_engine(km_subscriber *sub, const km_subscriber_worker *rank0,
                             uint32_t data_parallel_size)
{
    if (!sub || !rank0 || !rank0->endpoint)
        return KM_ERR_NULL_POINTER;
    if (data_parallel_size == 0 || rank0->worker + (uint64_t)data_parallel_size - 1 > UINT32_MAX)
        return set_error(sub, KM_ERR_INVALID_ARGUMENT, "data_parallel_size %u", data_parallel_size);
    for (uint32_t r = 0; r < data_parallel_size; r++) {
        char endpoint[KM_SUBSCRIBER_ENDPOINT_MAX], replay[KM_SUBSCRIBER_ENDPOINT_MAX];
        char name[KM_FEED_NAME_MAX];
        int rc = km_endpoint_for_rank(rank0->endpoint, r, endpoint, sizeof endpoint);
        if (!rc && rank0->replay_endpoint)
            rc = km_endpoint_for_rank(rank0->replay_endpoint, r, replay, sizeof replay);
        if (rc) {
            set_error(sub, rc, "rank %u of %s: no endpoint", r, rank0->endpoint);
        } else {
            snprintf(name, sizeof name, "%.200s/dp%u", rank0->name ? rank0->name : rank0->endpoint,
                     r);
            km_subscriber_worker w = {rank0->worker + r, name, endpoint,
                                      rank0->replay_endpoint ? replay : NULL};
            rc = km_subscriber_add_worker(sub, &w);
        }
        if (rc) {
            for (uint32_t k = 0; k < r; k++) {
                command c = {.kind = COMMAND_REMOVE, .id = rank0->worker + k};
                run_command(sub, &c);
            }
            return rc;
        }
    }
    return KM_OK;
}

int km_subscriber_remove_worker(km_subscriber *sub, uint32_t worker)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    command c = {.kind = COMMAND_REMOVE, .id = worker};
    return run_command(sub, &c);
}

int km_subscriber_resync_worker(km_subscriber *sub, uint32_t worker)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    command c = {.kind = COMMAND_RESYNC, .id = worker};
    return run_command(sub, &c);
}

/* Under the lock: collect a finished background snapshot (wait for it when `wait`). */
static void reap_snapshot_child(km_subscriber *sub, bool wait)
{
    if (!sub->snapshot_child)
        return;
    int status = 0;
    pid_t r;
    do
        r = waitpid(sub->snapshot_child, &status, wait ? 0 : WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == 0)
        return; /* still writing */
    char why[200] = "";
    if (sub->snapshot_pipe >= 0) {
        ssize_t n = read(sub->snapshot_pipe, why, sizeof why - 1);
        why[n > 0 ? n : 0] = '\0';
        close(sub->snapshot_pipe);
        sub->snapshot_pipe = -1;
    }
    pid_t child = sub->snapshot_child;
    sub->snapshot_child = 0;
    if (r > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        sub->stats.snapshots++;
        return;
    }
    /* A child that failed on its own removed its temporary file; one killed (the OOM killer: the
     * fork can double the memory a large index takes) left it, an index-sized file per failed
     * period. The previous snapshot, at the path itself, is untouched either way. */
    char tmp[4096];
    if (sub->config.snapshot_path &&
        km_index_save_temp_path(sub->config.snapshot_path, (long)child, tmp, sizeof tmp))
        unlink(tmp);
    sub->stats.snapshot_failures++;
    snprintf(sub->stats.last_snapshot_error, sizeof sub->stats.last_snapshot_error,
             "background snapshot failed (%s): %s",
             r < 0 ? "lost" : WIFEXITED(status) ? "exit status" : "killed by a signal",
             why[0] ? why : "no detail");
    snprintf(sub->last_error, sizeof sub->last_error, "%s", sub->stats.last_snapshot_error);
    sub_log(sub, KM_LOG_WARNING "%s", sub->stats.last_snapshot_error);
}

/* The same file: the same name, or the same inode. */
static bool same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    return !strcmp(a, b) || (stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
                             sa.st_ino == sb.st_ino);
}

/* Under the lock, right after a flush that left nothing queued: fork a child that writes the
 * snapshot from its copy-on-write image (only this thread exists in the child, holding the lock,
 * so it touches nothing another thread could have left half-changed: the feed and index are ours,
 * and with nothing to apply it logs nothing). Returns
 * false when fork failed (the caller writes in place). */
static bool save_in_background(km_subscriber *sub, const char *path, uint64_t now)
{
    if (sub->unrestorable[0] && same_file(path, sub->unrestorable))
        return false; /* save_locked moves it aside first, or refuses */
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        return false;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return false;
    }
    if (pid == 0) {
        close(fds[0]);
        int rc = km_feed_save(sub->feed, path, now);
        if (rc != KM_OK) {
            const char *e = km_feed_last_error(sub->feed);
            ssize_t w = write(fds[1], e, strlen(e));
            (void)w;
        }
        _exit(rc == KM_OK ? 0 : 1);
    }
    close(fds[1]);
    sub->snapshot_child = pid;
    sub->snapshot_pipe = fds[0];
    sub->last_snapshot_ns = now;
    return true;
}

/* Under the lock, before a snapshot is written to `path`: when path holds the snapshot that
 * failed to restore, move that file to "<path>.unrestorable-<UTC time>" (".1", ".2" ... after it
 * when the name is taken; an existing file is never replaced), so the only copy of what it held
 * is not overwritten. KM_OK when nothing is in the way; else the save must not happen. */
static int keep_unrestorable(km_subscriber *sub, const char *path)
{
    if (!sub->unrestorable[0] || !same_file(path, sub->unrestorable))
        return KM_OK;
    struct stat st;
    if (stat(sub->unrestorable, &st) != 0 && errno == ENOENT) {
        sub->unrestorable[0] = '\0'; /* gone meanwhile: nothing to keep */
        return KM_OK;
    }
    char stamp[32];
    time_t t = time(NULL);
    struct tm utc;
    gmtime_r(&t, &utc);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &utc);
    char target[sizeof sub->stats.unrestorable_kept_as];
    int err = 0;
    for (unsigned k = 0; k < 1000; k++) {
        int n = k ? snprintf(target, sizeof target, "%s.unrestorable-%s.%u", sub->unrestorable,
                             stamp, k)
                  : snprintf(target, sizeof target, "%s.unrestorable-%s", sub->unrestorable,
                             stamp);
        if (n < 0 || (size_t)n >= sizeof target) {
            err = ENAMETOOLONG;
            break;
        }
        /* link() refuses an existing target, where rename() would replace it. */
        if (link(sub->unrestorable, target) == 0) {
            err = unlink(sub->unrestorable) == 0 ? 0 : errno;
            if (err)
                unlink(target);
            break;
        }
        err = errno;
        if (err == EEXIST)
            continue;
        if (err == EPERM || err == EMLINK || err == ENOTSUP || err == EXDEV) {
            /* A file system without hard links: rename, checked first not to replace a file
             * (two writers choosing one name within the same second is not a case here). */
            if (access(target, F_OK) == 0)
                continue;
            err = rename(sub->unrestorable, target) == 0 ? 0 : errno;
        }
        break;
    }
    if (err) {
        snprintf(sub->last_error, sizeof sub->last_error,
                 "snapshot %s not written: it holds the snapshot that did not restore, which could "
                 "not be moved aside: %s", path, strerror(err));
        sub_log(sub, KM_LOG_ERROR "%s", sub->last_error);
        return KM_ERR_IO;
    }
    snprintf(sub->stats.unrestorable_kept_as, sizeof sub->stats.unrestorable_kept_as, "%s",
             target);
    sub_log(sub, KM_LOG_ERROR "the snapshot %s that did not restore (%s) was moved to %s; a new "
            "snapshot takes its path", sub->unrestorable, sub->stats.restore_error, target);
    sub->unrestorable[0] = '\0';
    return KM_OK;
}

/* Under the lock. */
static int save_locked(km_subscriber *sub, const char *path, uint64_t now)
{
    int rc = keep_unrestorable(sub, path);
    if (rc) {
        sub->stats.snapshot_failures++;
        snprintf(sub->stats.last_snapshot_error, sizeof sub->stats.last_snapshot_error, "%s",
                 sub->last_error);
        sub->last_snapshot_ns = now;
        return rc;
    }
    rc = km_feed_save(sub->feed, path, now);
    if (rc) {
        sub->stats.snapshot_failures++;
        snprintf(sub->last_error, sizeof sub->last_error, "%s", km_feed_last_error(sub->feed));
        snprintf(sub->stats.last_snapshot_error, sizeof sub->stats.last_snapshot_error, "%s",
                 km_feed_last_error(sub->feed));
    } else {
        sub->stats.snapshots++;
    }
    sub->last_snapshot_ns = now;
    return rc;
}

int km_subscriber_flush(km_subscriber *sub, km_feed_flush_stats *stats)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->flush_lock);
    pthread_mutex_lock(&sub->lock);
    /* The queued updates go to the index outside the lock: the I/O thread keeps receiving,
     * decoding and queuing meanwhile, on the other core. */
    bool taken = km_feed_flush_take(sub->feed);
    if (taken) {
        pthread_mutex_unlock(&sub->lock);
        km_feed_flush_apply(sub->feed);
        pthread_mutex_lock(&sub->lock);
    }
    uint64_t now = km_feed_clock_ns();
    int rc = km_feed_flush_finish(sub->feed, now, stats);
    if (taken)
        pthread_cond_broadcast(&sub->flush_done);
    if (rc)
        snprintf(sub->last_error, sizeof sub->last_error, "%s", km_feed_last_error(sub->feed));
    reap_snapshot_child(sub, false);
    if (!rc && !sub->snapshot_child && !sub->saves_waiting && sub->config.snapshot_path &&
        sub->config.snapshot_interval_ms &&
        now - sub->last_snapshot_ns >= (uint64_t)sub->config.snapshot_interval_ms * 1000000u) {
        /* What was queued while the index applied goes in now, under the lock, so the snapshot
         * has nothing left to apply: a forked child that applied it could log, through a callback
         * whose lock another thread may have held at the fork, and never end. */
        km_feed_flush_stats more;
        rc = km_feed_flush(sub->feed, now, &more);
        if (stats)
            km_feed_flush_stats_add(stats, &more);
        if (rc)
            snprintf(sub->last_error, sizeof sub->last_error, "%s", km_feed_last_error(sub->feed));
        else if (!(sub->config.snapshot_background &&
                   save_in_background(sub, sub->config.snapshot_path, now)) &&
                 save_locked(sub, sub->config.snapshot_path, now) != KM_OK)
            sub_log(sub, KM_LOG_WARNING "periodic snapshot failed: %s",
                    sub->stats.last_snapshot_error);
    }
    pthread_mutex_unlock(&sub->lock);
    pthread_mutex_unlock(&sub->flush_lock);
    return rc;
}

int km_subscriber_save(km_subscriber *sub, const char *path)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->lock);
    /* One writer at a time, and this one is the newest: a background child still writing is waited
     * for first, but not under the lock, which event intake and flushes need meanwhile (the child
     * may write for seconds). The wait leaves the child to reap_snapshot_child (WNOWAIT), so its
     * pid stays ours until it is reaped under the lock. A flush in flight is waited for too (the
     * index must hold what the state says). Flushes fork no new child while a save waits, through
     * both waits, each of which lets go of the lock: so both are checked again after either. */
    sub->saves_waiting++;
    for (;;) {
        if (sub->snapshot_child) {
            pid_t child = sub->snapshot_child;
            pthread_mutex_unlock(&sub->lock);
            siginfo_t info;
            while (waitid(P_PID, (id_t)child, &info, WEXITED | WNOWAIT) != 0 && errno == EINTR) {
            }
            pthread_mutex_lock(&sub->lock);
            reap_snapshot_child(sub, false); /* ended (or already reaped by another thread) */
        } else if (km_feed_flush_in_flight(sub->feed)) {
            pthread_cond_wait(&sub->flush_done, &sub->lock);
        } else {
            break;
        }
    }
    sub->saves_waiting--;
    const char *p = path ? path : sub->config.snapshot_path;
    int rc = p ? save_locked(sub, p, km_feed_clock_ns()) : KM_ERR_NULL_POINTER;
    pthread_mutex_unlock(&sub->lock);
    return rc;
}

int km_subscriber_get_worker_info(km_subscriber *sub, uint32_t worker, km_feed_worker_info *out)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->lock);
    int rc = km_feed_get_worker_info(sub->feed, worker, out);
    pthread_mutex_unlock(&sub->lock);
    return rc;
}

int km_subscriber_get_worker_windows(km_subscriber *sub, uint32_t worker, km_feed_window *out,
                                     uint32_t capacity, uint32_t *n_out)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->lock);
    int rc = km_feed_get_worker_windows(sub->feed, worker, out, capacity, n_out);
    pthread_mutex_unlock(&sub->lock);
    return rc;
}

int km_subscriber_get_workers(km_subscriber *sub, uint32_t *workers, uint32_t capacity,
                              uint32_t *n_out)
{
    if (!sub)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->lock);
    int rc = km_feed_get_workers(sub->feed, workers, capacity, n_out);
    pthread_mutex_unlock(&sub->lock);
    return rc;
}

int km_subscriber_get_stats(km_subscriber *sub, km_subscriber_stats *out)
{
    if (!sub || !out)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&sub->lock);
    reap_snapshot_child(sub, false);
    *out = sub->stats;
    pthread_mutex_unlock(&sub->lock);
    return KM_OK;
}
