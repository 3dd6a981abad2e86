/* SPDX-License-Identifier: Apache-2.0 */
/* C client of `kvmatch serve` (include/kvmatch/client.h): a non-blocking socket driven with
 * poll() so every call honours its timeout, the protocol's frame reader and codec, the ids of the
 * requests whose reply has not been returned yet, and a list of replies that arrived while the
 * caller waited for another id (kept as raw frames, decoded when handed out). */
#include "kvmatch/client.h"
#include "kvmatch/index.h"
#include "base/error_detail.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CLIENT_NAME   "kvmatch-c"
#define READ_BYTES    ((size_t)64 << 10)
#define ERROR_BYTES   512

/* A request whose reply has not been returned to the caller yet. */
typedef struct pending_request {
    uint64_t id;
    uint32_t items;   /* answer DECISION or ACK: the decisions or ACK items its reply must hold */
    uint8_t request;  /* the request's km_message_type */
    uint8_t answer;   /* the km_message_type of its reply besides ERROR; KM_MESSAGE_UNKNOWN: only
                       * an ERROR (the request is not one a server answers) */
    bool kept;        /* its reply arrived and is in the kept list */
    bool abandoned;   /* its blocking call timed out: the reply is dropped when it comes */
} pending_request;
_Static_assert(sizeof(pending_request) == 16, "client.h: 16 bytes per outstanding request");

/* A reply that arrived while the caller waited for another id. */
typedef struct kept_reply {
    struct kept_reply *next;
    uint64_t id;
    size_t size;
    uint8_t payload[];
} kept_reply;

struct km_client {
    int fd;
    bool closed; /* a final error happened: every call answers KM_ERR_CLOSED */
    uint64_t next_id;
    /* Outstanding requests, ascending by id (ids are handed out in order), in
     * pending[pending_start..pending_end): memory for the most that were ever in flight at once. */
    pending_request *pending;
    uint32_t pending_start, pending_end, pending_cap;
    uint32_t abandoned; /* pending requests given up by a timed-out blocking call */
    km_frame_reader *reader;
    km_protocol_decoder *decoder;
    km_frame_buffer out;
    uint8_t *read_buffer; /* bytes read from the socket, read_pos..read_end not yet framed */
    size_t read_pos, read_end;
    kept_reply *kept_head, *kept_tail;
    km_welcome welcome; /* strings below are copies */
    char kvmatch_version[64];
    char server_name[64];
    char last_error[ERROR_BYTES];
};

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int client_fail(km_client *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(c->last_error, sizeof c->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

/* A final failure: the stream cannot be trusted any more. No reply will be read: of the
 * outstanding requests, only those whose reply was kept can still be answered (a kept one was
 * never given up). */
static int client_break(km_client *c, int status)
{
    c->closed = true;
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    uint32_t n = 0;
    for (uint32_t i = c->pending_start; i < c->pending_end; i++)
        if (c->pending[i].kept)
            c->pending[n++] = c->pending[i];
    c->pending_start = 0;
    c->pending_end = n;
    c->abandoned = 0;
    return status;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t deadline_after(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

/* Milliseconds left before the deadline for poll(): -1 = none, 0 = expired. */
static int remaining_ms(int64_t deadline)
{
    if (deadline < 0)
        return -1;
    int64_t left = deadline - now_ms();
    if (left <= 0)
        return 0;
    return left > INT32_MAX ? INT32_MAX : (int)left;
}

/* Wait for `events` on the socket. KM_OK, KM_ERR_TIMEOUT or KM_ERR_IO. */
static int wait_socket(km_client *c, short events, int64_t deadline, const char *what)
{
    for (;;) {
        struct pollfd p = {.fd = c->fd, .events = events};
        int timeout = remaining_ms(deadline);
        int rc = poll(&p, 1, timeout);
        if (rc > 0)
            return KM_OK;
        if (rc == 0)
            return client_fail(c, KM_ERR_TIMEOUT, "%s: no progress before the timeout", what);
        if (errno != EINTR)
            return client_fail(c, KM_ERR_IO, "%s: poll: %s", what, strerror(errno));
    }
}

/* ---- connect ----------------------------------------------------------------------------------- */

static int parse_address(km_client *c, const char *address, struct sockaddr_storage *sa,
                         socklen_t *len)
{
    memset(sa, 0, sizeof *sa);
    if (strncmp(address, "unix:", 5) == 0) {
        const char *path = address + 5;
        struct sockaddr_un *un = (struct sockaddr_un *)sa;
        if (!path[0] || strlen(path) >= sizeof un->sun_path)
            return client_fail(c, KM_ERR_INVALID_ARGUMENT,
                               "unix socket path must be 1..%zu bytes: \"%s\"",
                               sizeof un->sun_path - 1, path);
        un->sun_family = AF_UNIX;
        memcpy(un->sun_path, path, strlen(path) + 1);
        *len = (socklen_t)sizeof *un;
        return KM_OK;
    }
    if (strncmp(address, "tcp:", 4) == 0) {
        const char *host = address + 4;
        char buf[80];
        const char *colon;
        size_t host_len;
        if (host[0] == '[') {
            const char *end = strchr(host, ']');
            if (!end || end[1] != ':')
                return client_fail(c, KM_ERR_INVALID_ARGUMENT,
                                   "expected tcp:[ipv6]:port, got \"%s\"", address);
            host_len = (size_t)(end - host - 1);
            host++;
            colon = end + 1;
        } else {
            colon = strrchr(host, ':');
            if (!colon)
                return client_fail(c, KM_ERR_INVALID_ARGUMENT, "expected tcp:host:port, got \"%s\"",
                                   address);
            host_len = (size_t)(colon - host);
        }
        char *end_port;
        long port = strtol(colon + 1, &end_port, 10);
        if (host_len == 0 || host_len >= sizeof buf || *end_port || colon[1] == 0 || port < 1 ||
            port > 65535)
            return client_fail(c, KM_ERR_INVALID_ARGUMENT, "bad tcp address \"%s\"", address);
        memcpy(buf, host, host_len);
        buf[host_len] = 0;
        struct sockaddr_in *in4 = (struct sockaddr_in *)sa;
        struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)sa;
        if (inet_pton(AF_INET, buf, &in4->sin_addr) == 1) {
            in4->sin_family = AF_INET;
            in4->sin_port = htons((uint16_t)port);
            *len = (socklen_t)sizeof *in4;
        } else if (inet_pton(AF_INET6, buf, &in6->sin6_addr) == 1) {
            in6->sin6_family = AF_INET6;
            in6->sin6_port = htons((uint16_t)port);
            *len = (socklen_t)sizeof *in6;
        } else {
            return client_fail(c, KM_ERR_INVALID_ARGUMENT,
                               "tcp host must be a numeric IPv4 or IPv6 address: \"%s\"", buf);
        }
        return KM_OK;
    }
    return client_fail(c, KM_ERR_INVALID_ARGUMENT,
                       "address must start with unix: or tcp:, got \"%s\"", address);
}

static int open_socket(km_client *c, const char *address, int64_t deadline)
{
    struct sockaddr_storage sa;
    socklen_t len = 0;
    int rc = parse_address(c, address, &sa, &len);
    if (rc)
        return rc;
    c->fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        return client_fail(c, KM_ERR_IO, "socket: %s", strerror(errno));
    if (sa.ss_family != AF_UNIX) {
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    /* A Unix socket's connect answers EAGAIN, not EINPROGRESS, while the server's listen queue is
     * full (the socket stays unconnected): try again until the deadline, as a blocking connect
     * would wait. */
    for (;;) {
        if (connect(c->fd, (struct sockaddr *)&sa, len) == 0)
            return KM_OK;
        if (errno == EINPROGRESS)
            break;
        if (errno != EAGAIN || sa.ss_family != AF_UNIX)
            return client_fail(c, KM_ERR_IO, "connect to %s: %s", address, strerror(errno));
        int left = remaining_ms(deadline);
        if (left == 0)
            return client_fail(c, KM_ERR_TIMEOUT,
                               "connect to %s: the server's listen queue stayed full", address);
        poll(NULL, 0, left < 0 || left > 10 ? 10 : left);
    }
    if ((rc = wait_socket(c, POLLOUT, deadline, "connect")))
        return rc;
    int err = 0;
    socklen_t err_len = sizeof err;
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &err_len) < 0)
        err = errno;
    if (err)
        return client_fail(c, KM_ERR_IO, "connect to %s: %s", address, strerror(err));
    return KM_OK;
}

/* ---- frames in and out ------------------------------------------------------------------------- */

/* Write the whole output buffer. */
static int flush_out(km_client *c, int64_t deadline)
{
    while (c->out.size) {
        ssize_t n = send(c->fd, c->out.data, c->out.size, MSG_NOSIGNAL);
        if (n > 0) {
            km_frame_buffer_consume(&c->out, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_socket(c, POLLOUT, deadline, "send");
            if (rc)
                return rc;
            continue;
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
            return client_fail(c, KM_ERR_CLOSED, "the server closed the connection");
        return client_fail(c, KM_ERR_IO, "send: %s", strerror(errno));
    }
    return KM_OK;
}

/* The next frame from the socket; the payload is valid until the next call. */
static int read_frame(km_client *c, int64_t deadline, const uint8_t **payload, size_t *size)
{
    for (;;) {
        if (c->read_pos < c->read_end) {
            size_t used = 0;
            int rc = km_frame_reader_next(c->reader, c->read_buffer + c->read_pos,
                                          c->read_end - c->read_pos, &used, payload, size);
            if (rc)
                return client_fail(c, rc, "reply stream: %s", km_frame_reader_last_error(c->reader));
            c->read_pos += used;
            if (*payload)
                return KM_OK;
            continue;
        }
        c->read_pos = c->read_end = 0;
        ssize_t n = recv(c->fd, c->read_buffer, READ_BYTES, 0);
        if (n > 0) {
            c->read_end = (size_t)n;
            continue;
        }
        if (n == 0)
            return client_fail(c, KM_ERR_CLOSED, "the server closed the connection%s",
                               km_frame_reader_pending(c->reader) ? " in the middle of a frame"
                                                                  : "");
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_socket(c, POLLIN, deadline, "receive");
            if (rc)
                return rc;
            continue;
        }
        if (errno == ECONNRESET)
            return client_fail(c, KM_ERR_CLOSED, "the server reset the connection");
        return client_fail(c, KM_ERR_IO, "recv: %s", strerror(errno));
    }
}

static int decode_reply(km_client *c, const uint8_t *payload, size_t size, km_message *reply)
{
    int rc = km_protocol_decode(c->decoder, payload, size, reply);
    if (rc)
        return client_fail(c, rc, "unreadable reply: %s",
                           km_protocol_decoder_last_error(c->decoder));
    return KM_OK;
}

static bool is_final(int status)
{
    return status != KM_OK && status != KM_ERR_TIMEOUT;
}

/* ---- public ------------------------------------------------------------------------------------ */

static void client_free(km_client *c)
{
    if (!c)
        return;
    if (c->fd >= 0)
        close(c->fd);
    km_frame_reader_destroy(c->reader);
    km_protocol_decoder_destroy(c->decoder);
    km_frame_buffer_free(&c->out);
    free(c->read_buffer);
    free(c->pending);
    kept_reply *k = c->kept_head;
    while (k) {
        kept_reply *next = k->next;
        free(k);
        k = next;
    }
    free(c);
}

void km_client_close(km_client *c)
{
    client_free(c);
}

const char *km_client_last_error(const km_client *c)
{
    return c ? c->last_error : "";
}

const km_welcome *km_client_welcome(const km_client *c)
{
    return c ? &c->welcome : NULL;
}

int km_client_fd(const km_client *c)
{
    return c ? c->fd : -1;
}

uint32_t km_client_outstanding(const km_client *c)
{
    return c ? c->pending_end - c->pending_start - c->abandoned : 0;
}

/* ---- outstanding requests ---------------------------------------------------------------------- */

/* Room for one more outstanding request, so that a request is only sent once it can be tracked. */
static int reserve_pending(km_client *c)
{
    if (c->pending_end < c->pending_cap)
        return KM_OK;
    if (c->pending_start > 0) {
        memmove(c->pending, c->pending + c->pending_start,
                (c->pending_end - c->pending_start) * sizeof *c->pending);
        c->pending_end -= c->pending_start;
        c->pending_start = 0;
        return KM_OK;
    }
    if (c->pending_cap >= UINT32_MAX / 2)
        return client_fail(c, KM_ERR_TOO_LARGE, "%u requests are waiting for a reply",
                           c->pending_cap);
    uint32_t cap = c->pending_cap ? 2 * c->pending_cap : 16;
    pending_request *p = realloc(c->pending, cap * sizeof *p);
    if (!p)
        return client_fail(c, KM_ERR_OUT_OF_MEMORY, "cannot track %u requests in flight", cap);
    c->pending = p;
    c->pending_cap = cap;
    return KM_OK;
}

/* The outstanding request `id`, or NULL: never sent, or its reply was already returned. */
static pending_request *find_pending(km_client *c, uint64_t id)
{
    uint32_t lo = c->pending_start, hi = c->pending_end;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (c->pending[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->pending_end && c->pending[lo].id == id ? &c->pending[lo] : NULL;
}

/* Its reply has been returned. Replies mostly come in send order, so the oldest is the common
 * case and costs nothing to drop. */
static void drop_pending(km_client *c, pending_request *p)
{
    c->abandoned -= p->abandoned;
    uint32_t i = (uint32_t)(p - c->pending);
    if (i == c->pending_start)
        c->pending_start++;
    else {
        memmove(p, p + 1, (c->pending_end - i - 1) * sizeof *p);
        c->pending_end--;
    }
    if (c->pending_start == c->pending_end)
        c->pending_start = c->pending_end = 0;
}

/* What the reply to `m` must be (docs/PROTOCOL.md, "Messages"): an ERROR, or the reply type of
 * its request, a DECISION holding one decision per route and an ACK one item per event, worker or
 * pool. */
static pending_request pending_for(const km_message *m)
{
    pending_request p = {.id = m->id, .request = (uint8_t)m->type, .answer = KM_MESSAGE_UNKNOWN};
    switch (m->type) {
    case KM_MESSAGE_ROUTE:
        p.answer = KM_MESSAGE_DECISION;
        p.items = m->route.n_routes;
        break;
    case KM_MESSAGE_LIFECYCLE:
        p.answer = KM_MESSAGE_ACK;
        p.items = m->lifecycle.n_events;
        break;
    case KM_MESSAGE_WORKERS:
        p.answer = m->workers.action == KM_ADMIN_LIST ? KM_MESSAGE_WORKER_LIST : KM_MESSAGE_ACK;
        p.items = m->workers.n_workers;
        break;
    case KM_MESSAGE_POOLS:
        p.answer = m->pools.action == KM_ADMIN_LIST ? KM_MESSAGE_POOL_LIST : KM_MESSAGE_ACK;
        p.items = m->pools.n_pools;
        break;
    case KM_MESSAGE_STATUS:
        p.answer = KM_MESSAGE_STATUS_REPLY;
        break;
    default:
        break;
    }
    return p;
}

static const char *plural(uint32_t n)
{
    return n == 1 ? "" : "s";
}

/* What the items of a request of this type are called. */
static const char *item_noun(uint8_t request)
{
    switch (request) {
    case KM_MESSAGE_ROUTE: return "route";
    case KM_MESSAGE_LIFECYCLE: return "event";
    case KM_MESSAGE_WORKERS: return "worker";
    default: return "pool";
    }
}

/* The outstanding request a reply just read answers. A reply to an id that is not outstanding, a
 * second reply to one, a reply of another type than its request's (ERROR aside) or a DECISION /
 * ACK whose count differs from its request's means the stream cannot be trusted: the connection
 * is closed. */
static pending_request *answered_request(km_client *c, const km_message *reply)
{
    pending_request *p = find_pending(c, reply->id);
    if (p && !p->kept) {
        if (reply->type == KM_MESSAGE_ERROR)
            return p;
        if (reply->type != p->answer) {
            client_fail(c, KM_ERR_PROTOCOL, "the server answered request %llu (%s) with %s",
                        (unsigned long long)reply->id,
                        km_message_type_name((km_message_type)p->request),
                        km_message_type_name(reply->type));
            client_break(c, KM_ERR_PROTOCOL);
            return NULL;
        }
        if (reply->type != KM_MESSAGE_DECISION && reply->type != KM_MESSAGE_ACK)
            return p;
        uint32_t n = reply->type == KM_MESSAGE_DECISION ? reply->decision.n_decisions
                                                        : reply->ack.n_items;
        if (n == p->items)
            return p;
        client_fail(c, KM_ERR_PROTOCOL, "the server answered request %llu with %u %s%s for %u %s%s",
                    (unsigned long long)reply->id, n,
                    reply->type == KM_MESSAGE_DECISION ? "decision" : "item", plural(n), p->items,
                    item_noun(p->request), plural(p->items));
        client_break(c, KM_ERR_PROTOCOL);
        return NULL;
    }
    client_fail(c, KM_ERR_PROTOCOL, "the server answered request %llu, which %s",
                (unsigned long long)reply->id,
                p ? "it had answered already" : "is not waiting for a reply");
    client_break(c, KM_ERR_PROTOCOL);
    return NULL;
}

/* An ERROR's message less a leading "KM_ERR_NAME: " of its own code (the server words what its
 * decoder refused that way), since the client's sentence names the code already. */
static const char *server_words(const km_error_reply *e)
{
    return km_error_detail(e->message, e->code);
}

static void copy_text(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

static int handshake(km_client *c, int64_t deadline)
{
    km_message hello = {.type = KM_MESSAGE_HELLO, .has_id = true, .id = c->next_id++};
    hello.hello.protocol_version = KM_PROTOCOL_VERSION;
    hello.hello.client_name = CLIENT_NAME;
    char why[256];
    int rc = km_protocol_encode(&hello, 0, &c->out, why, sizeof why);
    if (rc)
        return client_fail(c, rc, "HELLO: %s", why);
    /* A server that refuses the connection (max_connections, shutting down) writes an ERROR
     * saying why and closes, maybe before the HELLO is sent: the ERROR is still read. */
    int sent = flush_out(c, deadline);
    if (sent && sent != KM_ERR_CLOSED)
        return sent;
    const uint8_t *payload;
    size_t size;
    if ((rc = read_frame(c, deadline, &payload, &size)))
        return sent ? sent : rc;
    km_message reply;
    if ((rc = decode_reply(c, payload, size, &reply)))
        return rc;
    if (reply.type == KM_MESSAGE_ERROR)
        return client_fail(c, reply.error.code, "the server refused the handshake: %s",
                           server_words(&reply.error));
    if (reply.type != KM_MESSAGE_WELCOME)
        return client_fail(c, KM_ERR_PROTOCOL, "expected WELCOME, got %s",
                           km_message_type_name(reply.type));
    if (!reply.has_id || reply.id != hello.id)
        return client_fail(c, KM_ERR_PROTOCOL,
                           "the WELCOME answers request %llu, not the HELLO (%llu)",
                           (unsigned long long)reply.id, (unsigned long long)hello.id);
    if (reply.welcome.protocol_version != KM_PROTOCOL_VERSION)
        return client_fail(c, KM_ERR_INCOMPATIBLE, "the server speaks protocol %u, we speak %u",
                           reply.welcome.protocol_version, KM_PROTOCOL_VERSION);
    c->welcome = reply.welcome;
    copy_text(c->kvmatch_version, sizeof c->kvmatch_version, reply.welcome.kvmatch_version);
    copy_text(c->server_name, sizeof c->server_name, reply.welcome.server_name);
    c->welcome.kvmatch_version = c->kvmatch_version;
    c->welcome.server_name = reply.welcome.server_name ? c->server_name : NULL;
    return KM_OK;
}

/* The limits replies are read with, from the server's WELCOME (client.h; docs/PROTOCOL.md,
 * "Reading replies"). The server bounds a reply only by its max_frame_bytes, which stays the hard
 * bound; within a frame, every limit is either what the frame implies or a bound the server keeps
 * on what the reply lists. */
static void reply_limits(const km_protocol_limits *announced, km_protocol_limits *out)
{
    *out = *announced;
    /* Every msgpack value takes at least one byte of the frame, every string byte one byte, so
     * these two refuse nothing the frame can hold; decoding costs about 40 bytes per value. */
    out->max_objects = announced->max_frame_bytes;
    out->max_string_bytes = announced->max_frame_bytes;
    /* Decisions and ACK items number at most max_batch_items (one per route, event, worker or
     * pool of the request); WORKER_LIST and STATUS_REPLY list each worker of the server once,
     * POOL_LIST each pool, and a decision has one candidate row per worker of its pool: at most
     * KM_MAX_WORKERS_LIMIT workers, 4096 pools. These bound what the decoder allocates per item. */
    if (out->max_batch_items < KM_MAX_WORKERS_LIMIT)
        out->max_batch_items = KM_MAX_WORKERS_LIMIT;
    if (out->max_candidates < KM_MAX_WORKERS_LIMIT)
        out->max_candidates = KM_MAX_WORKERS_LIMIT;
    /* POOL_LIST lists each pool's policy parameters, fewer than the default max_params. */
    km_protocol_limits defaults;
    km_protocol_limits_init(&defaults);
    if (out->max_params < defaults.max_params)
        out->max_params = defaults.max_params;
}

/* After WELCOME: read every later reply with the server's limits. The old reader holds no bytes
 * (it stops at the end of the WELCOME frame); bytes already received stay in read_buffer. */
static int adopt_server_limits(km_client *c)
{
    km_protocol_limits limits;
    reply_limits(&c->welcome.limits, &limits);
    km_frame_reader *reader = NULL;
    km_protocol_decoder *decoder = NULL;
    if (km_frame_reader_create(limits.max_frame_bytes, &reader) ||
        km_protocol_decoder_create(&limits, &decoder)) {
        km_frame_reader_destroy(reader);
        return client_fail(c, KM_ERR_OUT_OF_MEMORY, "cannot allocate the reply decoder");
    }
    km_frame_reader_destroy(c->reader);
    km_protocol_decoder_destroy(c->decoder);
    c->reader = reader;
    c->decoder = decoder;
    return KM_OK;
}

int km_client_connect(const char *address, int timeout_ms, km_client **out, char *why,
                      size_t why_size)
{
    if (why && why_size)
        why[0] = 0;
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    if (!address) {
        if (why && why_size)
            snprintf(why, why_size, "KM_ERR_NULL_POINTER: address is NULL");
        return KM_ERR_NULL_POINTER;
    }
    km_client *c = calloc(1, sizeof *c);
    if (!c)
        return KM_ERR_OUT_OF_MEMORY;
    c->fd = -1;
    c->next_id = 1;
    km_frame_buffer_init(&c->out);
    int64_t deadline = deadline_after(timeout_ms);
    int rc = KM_OK;
    /* WELCOME is read with the default limits (strings up to 64 KiB); every later reply with the
     * limits the server announced in it (adopt_server_limits). */
    km_protocol_limits limits;
    km_protocol_limits_init(&limits);
    limits.max_string_bytes = 1u << 16;
    c->read_buffer = malloc(READ_BYTES);
    if (!c->read_buffer || km_frame_reader_create(limits.max_frame_bytes, &c->reader) ||
        km_protocol_decoder_create(&limits, &c->decoder))
        rc = client_fail(c, KM_ERR_OUT_OF_MEMORY, "cannot allocate the client");
    if (!rc)
        rc = open_socket(c, address, deadline);
    if (!rc)
        rc = handshake(c, deadline);
    if (!rc)
        rc = adopt_server_limits(c);
    if (rc) {
        if (why && why_size)
            snprintf(why, why_size, "%s", c->last_error);
        client_free(c);
        return rc;
    }
    *out = c;
    return KM_OK;
}

int km_client_send(km_client *c, const km_message *msg, int timeout_ms, uint64_t *id_out)
{
    if (!c || !msg)
        return KM_ERR_NULL_POINTER;
    if (c->closed)
        return client_fail(c, KM_ERR_CLOSED, "the connection is closed");
    if (msg->type == KM_MESSAGE_HELLO)
        return client_fail(c, KM_ERR_INVALID_ARGUMENT, "HELLO is sent by km_client_connect");
    int rc = reserve_pending(c);
    if (rc)
        return rc;
    km_message m = *msg;
    m.id = c->next_id;
    m.has_id = true;
    char why[ERROR_BYTES - 32];
    rc = km_protocol_encode(&m, c->welcome.limits.max_frame_bytes, &c->out, why, sizeof why);
    if (rc) {
        snprintf(c->last_error, sizeof c->last_error, "%s", why);
        return rc;
    }
    c->next_id++;
    if ((rc = flush_out(c, deadline_after(timeout_ms))))
        return client_break(c, rc);
    c->pending[c->pending_end++] = pending_for(&m);
    if (id_out)
        *id_out = m.id;
    return KM_OK;
}

int km_client_send_route(km_client *c, const km_route_request *routes, uint32_t n_routes,
                         int timeout_ms, uint64_t *id_out)
{
    km_message m = {.type = KM_MESSAGE_ROUTE};
    m.route.routes = routes;
    m.route.n_routes = n_routes;
    return km_client_send(c, &m, timeout_ms, id_out);
}

int km_client_send_lifecycle(km_client *c, const km_lifecycle_event *events, uint32_t n_events,
                             int timeout_ms, uint64_t *id_out)
{
    km_message m = {.type = KM_MESSAGE_LIFECYCLE};
    m.lifecycle.events = events;
    m.lifecycle.n_events = n_events;
    return km_client_send(c, &m, timeout_ms, id_out);
}

static int keep_reply(km_client *c, uint64_t id, const uint8_t *payload, size_t size)
{
    kept_reply *k = malloc(sizeof *k + size);
    if (!k)
        return client_fail(c, KM_ERR_OUT_OF_MEMORY, "cannot keep a reply of %zu bytes", size);
    k->next = NULL;
    k->id = id;
    k->size = size;
    memcpy(k->payload, payload, size);
    if (c->kept_tail)
        c->kept_tail->next = k;
    else
        c->kept_head = k;
    c->kept_tail = k;
    return KM_OK;
}

/* Decode and hand out a kept reply (removing it). */
static int take_kept(km_client *c, kept_reply *prev, kept_reply *k, km_message *reply)
{
    if (prev)
        prev->next = k->next;
    else
        c->kept_head = k->next;
    if (c->kept_tail == k)
        c->kept_tail = prev;
    drop_pending(c, find_pending(c, k->id)); /* kept only for an outstanding request */
    int rc = decode_reply(c, k->payload, k->size, reply);
    free(k);
    if (rc)
        return client_break(c, rc);
    return KM_OK;
}

/* A connection-level ERROR (no id or id 0): the server is about to close. */
static bool is_connection_error(const km_message *m)
{
    return m->type == KM_MESSAGE_ERROR && (!m->has_id || m->id == 0);
}

/* Read replies until one answers a request someone still waits for (late replies to given-up
 * calls are dropped on the way); *p is its pending request, *payload its bytes (valid until the
 * next read). Errors end the read: final ones break the connection. */
static int next_reply(km_client *c, int64_t deadline, km_message *reply, const uint8_t **payload,
                      size_t *size, pending_request **p)
{
    for (;;) {
        int rc = read_frame(c, deadline, payload, size);
        if (!rc)
            rc = decode_reply(c, *payload, *size, reply);
        if (rc)
            return is_final(rc) ? client_break(c, rc) : rc;
        if (is_connection_error(reply)) {
            /* Final whatever code the server chose (it may be one, such as KM_ERR_TIMEOUT, that
             * would tell the caller the connection is still usable): its code goes in the
             * sentence. */
            client_fail(c, KM_ERR_CLOSED, "the server closes the connection: %s (%d): %s",
                        km_error_name(reply->error.code), reply->error.code,
                        server_words(&reply->error));
            return client_break(c, KM_ERR_CLOSED);
        }
        if (!(*p = answered_request(c, reply)))
            return KM_ERR_PROTOCOL;
        if (!(*p)->abandoned)
            return KM_OK;
        drop_pending(c, *p); /* a late reply to a given-up call */
        memset(reply, 0, sizeof *reply);
    }
}

int km_client_receive(km_client *c, int timeout_ms, km_message *reply)
{
    if (!c || !reply)
        return KM_ERR_NULL_POINTER;
    memset(reply, 0, sizeof *reply);
    if (c->kept_head)
        return take_kept(c, NULL, c->kept_head, reply);
    if (c->closed)
        return client_fail(c, KM_ERR_CLOSED, "the connection is closed");
    if (km_client_outstanding(c) == 0)
        return client_fail(c, KM_ERR_INVALID_ARGUMENT, "no request is waiting for a reply");
    const uint8_t *payload;
    size_t size;
    pending_request *p;
    int rc = next_reply(c, deadline_after(timeout_ms), reply, &payload, &size, &p);
    if (!rc)
        drop_pending(c, p);
    return rc;
}

int km_client_wait(km_client *c, uint64_t id, int timeout_ms, km_message *reply)
{
    if (!c || !reply)
        return KM_ERR_NULL_POINTER;
    memset(reply, 0, sizeof *reply);
    pending_request *wanted = find_pending(c, id);
    if (wanted && wanted->kept)
        for (kept_reply *prev = NULL, *k = c->kept_head; k; prev = k, k = k->next)
            if (k->id == id)
                return take_kept(c, prev, k, reply);
    if (c->closed)
        return client_fail(c, KM_ERR_CLOSED, "the connection is closed");
    if (!wanted)
        return client_fail(c, KM_ERR_NOT_FOUND, "request %llu is not waiting for a reply",
                           (unsigned long long)id);
    int64_t deadline = deadline_after(timeout_ms);
    for (;;) {
        const uint8_t *payload;
        size_t size;
        pending_request *p;
        int rc = next_reply(c, deadline, reply, &payload, &size, &p);
        if (rc)
            return rc;
        if (reply->id == id) {
            drop_pending(c, p);
            return KM_OK;
        }
        /* A reply that cannot be kept is lost to its waiter for good: the stream is broken. */
        if ((rc = keep_reply(c, reply->id, payload, size)))
            return client_break(c, rc);
        p->kept = true;
        memset(reply, 0, sizeof *reply);
    }
}

int km_client_call(km_client *c, const km_message *request, int timeout_ms, km_message *reply)
{
    if (!c || !request || !reply)
        return KM_ERR_NULL_POINTER;
    int64_t deadline = deadline_after(timeout_ms);
    uint64_t id;
    int rc = km_client_send(c, request, timeout_ms, &id);
    if (rc)
        return rc;
    rc = km_client_wait(c, id, remaining_ms(deadline) < 0 ? -1 : remaining_ms(deadline), reply);
    if (rc == KM_ERR_TIMEOUT) {
        /* Given up: no one will wait for this id, so its reply is dropped when it comes instead
         * of being kept for good. */
        pending_request *p = find_pending(c, id);
        if (p && !p->kept && !p->abandoned) {
            p->abandoned = true;
            c->abandoned++;
        }
    }
    if (rc)
        return rc;
    if (reply->type == KM_MESSAGE_ERROR)
        return client_fail(c, reply->error.code, "%s", server_words(&reply->error));
    return KM_OK;
}

int km_client_route(km_client *c, const km_route_request *routes, uint32_t n_routes,
                    int timeout_ms, km_message *reply)
{
    km_message m = {.type = KM_MESSAGE_ROUTE};
    m.route.routes = routes;
    m.route.n_routes = n_routes;
    return km_client_call(c, &m, timeout_ms, reply);
}

int km_client_lifecycle(km_client *c, const km_lifecycle_event *events, uint32_t n_events,
                        int timeout_ms, km_message *reply)
{
    km_message m = {.type = KM_MESSAGE_LIFECYCLE};
    m.lifecycle.events = events;
    m.lifecycle.n_events = n_events;
    return km_client_call(c, &m, timeout_ms, reply);
}

int km_client_status(km_client *c, int timeout_ms, km_message *reply)
{
    km_message m = {.type = KM_MESSAGE_STATUS};
    return km_client_call(c, &m, timeout_ms, reply);
}
