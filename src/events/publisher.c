/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM-compatible KV-event publisher (include/kvmatch/publisher.h): an XPUB for live messages (an
 * XPUB so the publisher can tell when subscribers are connected) and a ROUTER replay endpoint
 * served by its own thread from a bounded ring of the newest messages. */
#include "base/error_detail.h"
#include "base/array.h"
#include "kvmatch/publisher.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

typedef struct buffered {
    uint64_t seq;
    void *payload;
    size_t size;
} buffered;

typedef struct pending_request {
    unsigned char identity[256];
    size_t identity_size;
    uint64_t start;
} pending_request;

struct km_publisher {
    km_publisher_config config;
    char topic[256];
    void *ctx;
    void *pub;                   /* XPUB: the publishing thread only */
    void *router;                /* replay thread only */
    void *stop_recv, *stop_send; /* inproc PAIR to wake the replay thread */
    char endpoint[256], replay_endpoint[256];
    pthread_t thread;
    bool thread_started;
    uint32_t subscriptions; /* seen on the XPUB (publishing thread) */

    pthread_mutex_t lock; /* everything below */
    uint64_t next_seq;
    buffered *ring; /* buffer_steps entries */
    uint32_t ring_head, ring_count;
    buffered *log;
    size_t log_count, log_capacity;
    bool drop_live, hold, mute;
    uint32_t delay_us;
    uint32_t drop_after, drop_count; /* the next answer loses items [after, after + count) */
    uint64_t replay_requests;
    pending_request *pending;
    size_t pending_count, pending_capacity;
};

void km_publisher_config_init(km_publisher_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->endpoint = "tcp://127.0.0.1:*";
    cfg->replay_endpoint = "tcp://127.0.0.1:*";
    cfg->replay = true;
    cfg->buffer_steps = 10000;
    cfg->replay_form = KM_REPLAY_WITH_TOPIC;
}

static void be64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (56 - 8 * i));
}

static int send_parts(void *sock, const km_kv_frame *frames, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (zmq_send(sock, frames[i].data, frames[i].size, i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
            return -1;
    return 0;
}

/* Answer one replay request like vLLM's _service_replay: every buffered message with
 * seq >= start, then the end marker. The buffer is copied first so publishing is not blocked; if
 * the copy cannot be made only the end marker is sent (the subscriber sees a replay that starts
 * late: history lost, which is what happened). */
static void serve_replay(km_publisher *p, const pending_request *req)
{
    pthread_mutex_lock(&p->lock);
    uint32_t n = 0;
    buffered *copy = malloc(((size_t)p->ring_count + 1) * sizeof *copy);
    for (uint32_t i = 0; copy && i < p->ring_count; i++) {
        const buffered *b = &p->ring[(p->ring_head + i) % p->config.buffer_steps];
        if (b->seq < req->start)
            continue;
        void *data = malloc(b->size ? b->size : 1);
        if (!data)
            break;
        memcpy(data, b->payload, b->size);
        copy[n++] = (buffered){b->seq, data, b->size};
    }
    uint32_t delay = p->delay_us;
    uint32_t drop_after = p->drop_after, drop_count = p->drop_count;
    p->drop_count = 0;
    pthread_mutex_unlock(&p->lock);
    bool with_topic = p->config.replay_form == KM_REPLAY_WITH_TOPIC;
    for (uint32_t i = 0; i < n; i++) {
        unsigned char seq[8];
        be64(seq, copy[i].seq);
        km_kv_frame f[5] = {{req->identity, req->identity_size}, {NULL, 0}};
        size_t k = 2;
        if (with_topic)
            f[k++] = (km_kv_frame){p->topic, strlen(p->topic)};
        f[k++] = (km_kv_frame){seq, 8};
        f[k++] = (km_kv_frame){copy[i].payload, copy[i].size};
        if (i < drop_after || i - drop_after >= drop_count)
            send_parts(p->router, f, k);
        free(copy[i].payload);
        if (delay) {
            struct timespec ts = {0, (long)delay * 1000L};
            nanosleep(&ts, NULL);
        }
    }
    free(copy);
    unsigned char end[8];
    memset(end, 0xFF, 8);
    km_kv_frame f[5] = {{req->identity, req->identity_size}, {NULL, 0}};
    size_t k = 2;
    if (with_topic)
        f[k++] = (km_kv_frame){NULL, 0};
    f[k++] = (km_kv_frame){end, 8};
    f[k++] = (km_kv_frame){NULL, 0};
    send_parts(p->router, f, k);
}

static void take_request(km_publisher *p)
{
    /* [identity, empty, start_seq]: anything else is ignored, as vLLM does. */
    zmq_msg_t parts[4];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, p->router, 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 4)
            parts[n++] = m;
        else
            zmq_msg_close(&m);
    }
    if (n == 3 && zmq_msg_size(&parts[1]) == 0 && zmq_msg_size(&parts[0]) <= 256 &&
        zmq_msg_size(&parts[2]) >= 1 && zmq_msg_size(&parts[2]) <= 8) {
        pending_request req;
        req.identity_size = zmq_msg_size(&parts[0]);
        memcpy(req.identity, zmq_msg_data(&parts[0]), req.identity_size);
        req.start = 0;
        const unsigned char *s = zmq_msg_data(&parts[2]);
        for (size_t i = 0; i < zmq_msg_size(&parts[2]); i++)
            req.start = req.start << 8 | s[i];
        pthread_mutex_lock(&p->lock);
        p->replay_requests++;
        if (!p->mute) {
            /* Without room the request goes unanswered, as a lost one would. */
            if (!KM_ARRAY_GROW(p->pending, p->pending_capacity, p->pending_count + 1, 8))
                p->pending[p->pending_count++] = req;
        }
        pthread_mutex_unlock(&p->lock);
    }
    for (int i = 0; i < n; i++)
        zmq_msg_close(&parts[i]);
}

static void *replay_thread(void *arg)
{
    km_publisher *p = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{p->router, 0, ZMQ_POLLIN, 0}, {p->stop_recv, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(items, 2, 5);
        if (rc < 0 && errno != EINTR)
            break;
        if (items[1].revents & ZMQ_POLLIN) {
            char c = 0;
            zmq_recv(p->stop_recv, &c, 1, 0);
            if (c == 'q')
                break;
        }
        if (items[0].revents & ZMQ_POLLIN)
            take_request(p);
        /* Serve what is pending unless held. */
        for (;;) {
            pthread_mutex_lock(&p->lock);
            if (p->hold || p->pending_count == 0) {
                pthread_mutex_unlock(&p->lock);
                break;
            }
            pending_request req = p->pending[0];
            memmove(p->pending, p->pending + 1, (p->pending_count - 1) * sizeof *p->pending);
            p->pending_count--;
            pthread_mutex_unlock(&p->lock);
            serve_replay(p, &req);
        }
    }
    return NULL;
}

static int bind_socket(void *sock, const char *address, char *bound, size_t bound_size, char *why,
                       size_t why_size, const char *what)
{
    if (zmq_bind(sock, address) != 0)
        return km_why(why, why_size, KM_ERR_IO, "%s %s: %s", what, address, zmq_strerror(errno));
    size_t len = bound_size;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, bound, &len) != 0)
        return km_why(why, why_size, KM_ERR_IO, "%s %s: %s", what, address, zmq_strerror(errno));
    return KM_OK;
}

int km_publisher_start(const km_publisher_config *cfg_in, km_publisher **out, char *why,
                       size_t why_size)
{
    if (!out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "out is NULL");
    *out = NULL;
    km_publisher *p = calloc(1, sizeof *p);
    if (!p)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "publisher");
    if (cfg_in)
        p->config = *cfg_in;
    else
        km_publisher_config_init(&p->config);
    if (!p->config.endpoint)
        p->config.endpoint = "tcp://127.0.0.1:*";
    if (!p->config.replay_endpoint)
        p->config.replay_endpoint = "tcp://127.0.0.1:*";
    pthread_mutex_init(&p->lock, NULL);
    int rc = KM_OK;
    if (p->config.buffer_steps == 0)
        rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "buffer_steps must be at least 1");
    if (!rc && p->config.topic && strlen(p->config.topic) >= sizeof p->topic)
        rc = km_why(why, why_size, KM_ERR_TOO_LARGE, "topic longer than %zu bytes", sizeof p->topic - 1);
    if (!rc) {
        snprintf(p->topic, sizeof p->topic, "%s", p->config.topic ? p->config.topic : "");
        p->config.topic = NULL; /* the copy above is what is used */
        p->config.endpoint = NULL;
        p->ring = calloc(p->config.buffer_steps, sizeof *p->ring);
        p->ctx = zmq_ctx_new();
        if (!p->ring || !p->ctx)
            rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "publisher ring or ZMQ context");
    }
    const char *endpoint = cfg_in && cfg_in->endpoint ? cfg_in->endpoint : "tcp://127.0.0.1:*";
    const char *replay_endpoint =
        cfg_in && cfg_in->replay_endpoint ? cfg_in->replay_endpoint : "tcp://127.0.0.1:*";
    int one = 1, zero = 0, hwm = 100000;
    if (!rc) {
        p->pub = zmq_socket(p->ctx, ZMQ_XPUB);
        p->router = zmq_socket(p->ctx, ZMQ_ROUTER);
        p->stop_recv = zmq_socket(p->ctx, ZMQ_PAIR);
        p->stop_send = zmq_socket(p->ctx, ZMQ_PAIR);
        if (!p->pub || !p->router || !p->stop_recv || !p->stop_send)
            rc = km_why(why, why_size, KM_ERR_IO, "ZMQ sockets: %s", zmq_strerror(errno));
    }
    if (!rc) {
        zmq_setsockopt(p->pub, ZMQ_XPUB_VERBOSE, &one, sizeof one);
        zmq_setsockopt(p->pub, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(p->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
        zmq_setsockopt(p->router, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(p->stop_recv, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(p->stop_send, ZMQ_LINGER, &zero, sizeof zero);
        rc = bind_socket(p->pub, endpoint, p->endpoint, sizeof p->endpoint, why, why_size,
                         "publisher endpoint");
    }
    /* Without replay the ROUTER stays unbound: nobody connects, the thread loop stays uniform. */
    if (!rc && p->config.replay)
        rc = bind_socket(p->router, replay_endpoint, p->replay_endpoint, sizeof p->replay_endpoint,
                         why, why_size, "replay endpoint");
    if (!rc) {
        char inproc[64];
        snprintf(inproc, sizeof inproc, "inproc://km-publisher-%p", (void *)p);
        if (zmq_bind(p->stop_recv, inproc) != 0 || zmq_connect(p->stop_send, inproc) != 0)
            rc = km_why(why, why_size, KM_ERR_IO, "wake-up pair: %s", zmq_strerror(errno));
    }
    if (!rc) {
        if (pthread_create(&p->thread, NULL, replay_thread, p) != 0)
            rc = km_why(why, why_size, KM_ERR_IO, "starting the replay thread");
        else
            p->thread_started = true;
    }
    if (rc) {
        km_publisher_stop(p);
        return rc;
    }
    *out = p;
    return KM_OK;
}

void km_publisher_stop(km_publisher *p)
{
    if (!p)
        return;
    if (p->thread_started) {
        zmq_send(p->stop_send, "q", 1, 0);
        pthread_join(p->thread, NULL);
    }
    if (p->stop_send)
        zmq_close(p->stop_send);
    if (p->stop_recv)
        zmq_close(p->stop_recv);
    if (p->router)
        zmq_close(p->router);
    if (p->pub)
        zmq_close(p->pub);
    if (p->ctx)
        zmq_ctx_term(p->ctx);
    for (uint32_t i = 0; p->ring && i < p->ring_count; i++)
        free(p->ring[(p->ring_head + i) % p->config.buffer_steps].payload);
    free(p->ring);
    for (size_t i = 0; i < p->log_count; i++)
        free(p->log[i].payload);
    free(p->log);
    free(p->pending);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

const char *km_publisher_endpoint(const km_publisher *p)
{
    return p ? p->endpoint : NULL;
}

const char *km_publisher_replay_endpoint(const km_publisher *p)
{
    return p && p->config.replay ? p->replay_endpoint : NULL;
}

int km_publisher_publish(km_publisher *p, const void *payload, size_t size, uint64_t *seq_out)
{
    if (!p || (!payload && size))
        return KM_ERR_NULL_POINTER;
    void *copy = malloc(size ? size : 1);
    void *log_copy = p->config.keep_log ? malloc(size ? size : 1) : NULL;
    if (!copy || (p->config.keep_log && !log_copy)) {
        free(copy);
        free(log_copy);
        return KM_ERR_OUT_OF_MEMORY;
    }
    if (size) {
        memcpy(copy, payload, size);
        if (log_copy)
            memcpy(log_copy, payload, size);
    }
    pthread_mutex_lock(&p->lock);
    if (log_copy && KM_ARRAY_GROW(p->log, p->log_capacity, p->log_count + 1, 64)) {
        pthread_mutex_unlock(&p->lock);
        free(copy);
        free(log_copy);
        return KM_ERR_OUT_OF_MEMORY;
    }
    uint64_t seq = p->next_seq++;
    uint32_t steps = p->config.buffer_steps;
    if (p->ring_count == steps) {
        free(p->ring[p->ring_head].payload);
        p->ring_head = (p->ring_head + 1) % steps;
        p->ring_count--;
    }
    p->ring[(p->ring_head + p->ring_count) % steps] = (buffered){seq, copy, size};
    p->ring_count++;
    if (log_copy)
        p->log[p->log_count++] = (buffered){seq, log_copy, size};
    bool drop = p->drop_live;
    pthread_mutex_unlock(&p->lock);
    if (seq_out)
        *seq_out = seq;
    if (drop)
        return KM_OK;
    unsigned char s[8];
    be64(s, seq);
    km_kv_frame f[3] = {{p->topic, strlen(p->topic)}, {s, 8}, {payload, size}};
    return send_parts(p->pub, f, 3) == 0 ? KM_OK : KM_ERR_IO;
}

void km_publisher_drop_live(km_publisher *p, bool drop)
{
    pthread_mutex_lock(&p->lock);
    p->drop_live = drop;
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_restart(km_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    p->next_seq = 0;
    for (uint32_t i = 0; i < p->ring_count; i++)
        free(p->ring[(p->ring_head + i) % p->config.buffer_steps].payload);
    p->ring_head = p->ring_count = 0;
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_evict(km_publisher *p, uint32_t keep)
{
    pthread_mutex_lock(&p->lock);
    while (p->ring_count > keep) {
        free(p->ring[p->ring_head].payload);
        p->ring_head = (p->ring_head + 1) % p->config.buffer_steps;
        p->ring_count--;
    }
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_hold_replay(km_publisher *p, bool hold)
{
    pthread_mutex_lock(&p->lock);
    p->hold = hold;
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_mute_replay(km_publisher *p, bool mute)
{
    pthread_mutex_lock(&p->lock);
    p->mute = mute;
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_replay_delay_us(km_publisher *p, uint32_t us)
{
    pthread_mutex_lock(&p->lock);
    p->delay_us = us;
    pthread_mutex_unlock(&p->lock);
}

void km_publisher_drop_replay_items(km_publisher *p, uint32_t after, uint32_t count)
{
    pthread_mutex_lock(&p->lock);
    p->drop_after = after;
    p->drop_count = count;
    pthread_mutex_unlock(&p->lock);
}

int km_publisher_send_frames(km_publisher *p, const km_kv_frame *frames, size_t n)
{
    return send_parts(p->pub, frames, n) == 0 ? KM_OK : KM_ERR_IO;
}

uint64_t km_publisher_next_seq(km_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    uint64_t n = p->next_seq;
    pthread_mutex_unlock(&p->lock);
    return n;
}

uint64_t km_publisher_replay_requests(km_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    uint64_t n = p->replay_requests;
    pthread_mutex_unlock(&p->lock);
    return n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

bool km_publisher_wait_subscribers(km_publisher *p, uint32_t n, int timeout_ms)
{
    double deadline = now_s() + timeout_ms / 1000.0;
    while (p->subscriptions < n) {
        double left = deadline - now_s();
        if (left <= 0)
            return false;
        zmq_pollitem_t item = {p->pub, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, (long)(left * 1000) + 1) <= 0)
            continue;
        unsigned char buf[256];
        int got = zmq_recv(p->pub, buf, sizeof buf, ZMQ_DONTWAIT);
        if (got >= 1 && buf[0] == 1)
            p->subscriptions++;
    }
    return true;
}

size_t km_publisher_log_count(km_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    size_t n = p->log_count;
    pthread_mutex_unlock(&p->lock);
    return n;
}

const void *km_publisher_log_entry(km_publisher *p, size_t i, uint64_t *seq, size_t *size)
{
    pthread_mutex_lock(&p->lock);
    const void *data = NULL;
    if (i < p->log_count) {
        *seq = p->log[i].seq;
        *size = p->log[i].size;
        data = p->log[i].payload;
    }
    pthread_mutex_unlock(&p->lock);
    return data;
}
