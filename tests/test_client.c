/* SPDX-License-Identifier: Apache-2.0 */
/* The C client library (include/kvmatch/client.h) against a small fake server run in a thread of
 * the test: it accepts on a temporary Unix socket under /tmp (or TCP on 127.0.0.1), reads frames
 * with the protocol's own reader and decoder, and answers with DECISIONs computed from the
 * request (so a reply matched to the wrong request is caught), optionally holding replies and
 * sending them in reverse order (the pipelined tests), staying silent (timeouts), refusing the
 * handshake, or closing; and against the real server in a thread, for the largest reply it sends.
 * Every test bounds its time. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kvmatch/client.h"
#include "kvmatch/server.h"
#include "test_util.h"

/* ---- the fake server ----------------------------------------------------------------------------- */

typedef enum fake_mode {
    FAKE_NORMAL = 0,
    FAKE_REVERSE = 1,      /* hold replies, send each group of `group` in reverse order */
    FAKE_SILENT_ROUTE = 2, /* never answer ROUTE */
    FAKE_REFUSE_HELLO = 3, /* answer HELLO with ERROR KM_ERR_INCOMPATIBLE and close */
    FAKE_CLOSE_ON_ROUTE = 4, /* close the connection when a ROUTE arrives */
    FAKE_SMALL_FRAMES = 5,   /* announce max_frame_bytes = FAKE_SMALL_FRAME_BYTES, reply as usual */
    FAKE_ROUTE_TWICE = 6,    /* answer every ROUTE twice */
    FAKE_LATE_ROUTE = 7,     /* answer ROUTE after 400 ms */
    FAKE_MISCOUNT = 8,       /* one decision fewer than routes, one ACK item more than events */
    FAKE_CONNECTION_ERROR = 9, /* answer ROUTE with ERROR id 0 KM_ERR_TIMEOUT, and close */
    FAKE_WRONG_TYPE = 10,      /* answer ROUTE with a STATUS_REPLY */
    FAKE_WELCOME_WRONG_ID = 11, /* answer HELLO with a WELCOME to another id */
    FAKE_ONE_ROUTE = 12,        /* decode with max_batch_items 1: a ROUTE of two gets an ERROR */
} fake_mode;

#define FAKE_SMALL_FRAME_BYTES 1024u

typedef struct fake_server {
    int listen_fd;
    char path[108];
    uint16_t port;
    fake_mode mode;
    uint32_t group;
    pthread_t thread;
    int requests_seen;
} fake_server;

/* The decision the fake server makes: worker = sum of the input mod 7 (+ route index). */
static uint32_t fake_choice(const km_route_request *q, uint32_t index)
{
    uint64_t sum = index;
    for (uint32_t i = 0; i < q->n_tokens; i++)
        sum += q->tokens[i];
    for (uint32_t i = 0; i < q->n_hashes; i++)
        sum += q->hashes[i];
    return (uint32_t)(sum % 7);
}

static void write_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) {
            if (w < 0 && errno == EINTR)
                continue;
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

/* Encode one reply to `m` into `out`; returns false to close the connection. */
static bool fake_reply(fake_server *s, const km_message *m, km_frame_buffer *out)
{
    km_message reply = {.has_id = true, .id = m->id};
    switch (m->type) {
    case KM_MESSAGE_HELLO:
        if (s->mode == FAKE_REFUSE_HELLO || m->hello.protocol_version != KM_PROTOCOL_VERSION) {
            km_protocol_encode_error(m->id, KM_ERR_INCOMPATIBLE, "protocol 1 only", out);
            return false;
        }
        reply.type = KM_MESSAGE_WELCOME;
        if (s->mode == FAKE_WELCOME_WRONG_ID)
            reply.id = m->id + 1;
        reply.welcome.protocol_version = KM_PROTOCOL_VERSION;
        reply.welcome.kvmatch_version = "0.1.0-fake";
        reply.welcome.server_name = "fake";
        km_protocol_limits_init(&reply.welcome.limits);
        if (s->mode == FAKE_SMALL_FRAMES)
            reply.welcome.limits.max_frame_bytes = FAKE_SMALL_FRAME_BYTES;
        break;
    case KM_MESSAGE_ROUTE: {
        if (s->mode == FAKE_CLOSE_ON_ROUTE)
            return false;
        if (s->mode == FAKE_CONNECTION_ERROR) {
            km_protocol_encode_error(0, KM_ERR_TIMEOUT, "fake server gives up", out);
            return false;
        }
        if (s->mode == FAKE_WRONG_TYPE) {
            reply.type = KM_MESSAGE_STATUS_REPLY;
            reply.status_reply.kvmatch_version = "0.1.0-fake";
            break;
        }
        if (s->mode == FAKE_SILENT_ROUTE)
            return true;
        if (s->mode == FAKE_LATE_ROUTE)
            nanosleep(&(struct timespec){0, 400000000L}, NULL);
        km_route_decision *d = calloc(m->route.n_routes, sizeof *d);
        km_candidate_score *c = calloc(m->route.n_routes, sizeof *c);
        for (uint32_t i = 0; i < m->route.n_routes; i++) {
            const km_route_request *q = &m->route.routes[i];
            d[i].request_id = q->request_id;
            d[i].attempt_id = q->attempt_id;
            if (q->status != KM_OK) {
                d[i].status = q->status;
                d[i].message = q->message;
                continue;
            }
            d[i].decision_id = m->id * 1000 + i;
            d[i].pool = q->pool ? q->pool : "default";
            d[i].chosen_worker = fake_choice(q, i);
            d[i].chosen_depth = q->n_hashes;
            d[i].chosen_state = "LIVE";
            d[i].has_owner = true;
            d[i].owner_worker = (d[i].chosen_worker + 1) % 7;
            d[i].owner_depth = q->n_hashes + 1;
            d[i].owner_state = "GAP";
            d[i].source = q->input == KM_ROUTE_INPUT_HASHES ? KM_PREDICTION_EVENTS : KM_PREDICTION_APPROX;
            d[i].policy = "kv";
            d[i].load_kind = "in_flight";
            d[i].load_scope = "this_instance";
            c[i].worker = d[i].chosen_worker;
            c[i].depth = q->n_hashes;
            c[i].state = "LIVE";
            c[i].eligible = true;
            d[i].candidates = &c[i];
            d[i].n_candidates = 1;
        }
        reply.type = KM_MESSAGE_DECISION;
        reply.decision.kvmatch_version = "0.1.0-fake";
        reply.decision.decisions = d;
        reply.decision.n_decisions = m->route.n_routes - (s->mode == FAKE_MISCOUNT);
        km_protocol_encode(&reply, 0, out, NULL, 0);
        free(d);
        free(c);
        return true;
    }
    case KM_MESSAGE_LIFECYCLE: {
        km_item_status *items = calloc(m->lifecycle.n_events + 1, sizeof *items);
        for (uint32_t i = 0; i < m->lifecycle.n_events; i++) {
            items[i].status = m->lifecycle.events[i].status;
            items[i].message = m->lifecycle.events[i].message;
        }
        reply.type = KM_MESSAGE_ACK;
        reply.ack.items = items;
        reply.ack.n_items = m->lifecycle.n_events + (s->mode == FAKE_MISCOUNT);
        km_protocol_encode(&reply, 0, out, NULL, 0);
        free(items);
        return true;
    }
    case KM_MESSAGE_STATUS:
        km_protocol_encode_error(m->id, KM_ERR_SHUTTING_DOWN, "fake server is draining", out);
        return true;
    default:
        km_protocol_encode_error(m->id, KM_ERR_PROTOCOL, "fake server: unsupported type", out);
        return true;
    }
    km_protocol_encode(&reply, 0, out, NULL, 0);
    return true;
}

/* Serve one connection until EOF or close. */
static void fake_serve(fake_server *s, int fd)
{
    km_frame_reader *reader;
    km_protocol_decoder *dec;
    km_frame_reader_create(0, &reader);
    km_protocol_limits limits;
    km_protocol_limits_init(&limits);
    if (s->mode == FAKE_ONE_ROUTE)
        limits.max_batch_items = 1;
    km_protocol_decoder_create(&limits, &dec);
    km_frame_buffer held[64]; /* FAKE_REVERSE: replies waiting */
    uint32_t n_held = 0;
    uint8_t buf[16384];
    bool open = true;
    while (open) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0)
            break;
        const uint8_t *p = buf;
        size_t left = (size_t)n;
        while (open && left) {
            size_t used;
            const uint8_t *payload;
            size_t size;
            if (km_frame_reader_next(reader, p, left, &used, &payload, &size)) {
                open = false;
                break;
            }
            p += used;
            left -= used;
            if (!payload)
                continue;
            km_message m;
            km_frame_buffer out;
            km_frame_buffer_init(&out);
            int rc = km_protocol_decode(dec, payload, size, &m);
            if (rc) { /* as the server words it */
                km_protocol_encode_error(m.has_id ? m.id : 0, rc,
                                         km_protocol_decoder_last_error(dec), &out);
            } else {
                s->requests_seen++;
                open = fake_reply(s, &m, &out);
            }
            if (s->mode == FAKE_REVERSE && m.type != KM_MESSAGE_HELLO && out.size) {
                held[n_held++] = out;
                if (n_held == s->group) {
                    while (n_held) {
                        km_frame_buffer *h = &held[--n_held];
                        write_all(fd, h->data, h->size);
                        km_frame_buffer_free(h);
                    }
                }
                continue;
            }
            write_all(fd, out.data, out.size);
            if (s->mode == FAKE_ROUTE_TWICE && m.type == KM_MESSAGE_ROUTE)
                write_all(fd, out.data, out.size);
            km_frame_buffer_free(&out);
        }
    }
    while (n_held)
        km_frame_buffer_free(&held[--n_held]);
    close(fd);
    km_frame_reader_destroy(reader);
    km_protocol_decoder_destroy(dec);
}

static void *fake_main(void *arg)
{
    fake_server *s = arg;
    for (;;) {
        int fd = accept(s->listen_fd, NULL, NULL);
        if (fd < 0)
            return NULL; /* listening socket shut down */
        fake_serve(s, fd);
    }
}

static void fake_start(fake_server *s, fake_mode mode, bool tcp)
{
    memset(s, 0, sizeof *s);
    s->mode = mode;
    s->group = 8;
    if (tcp) {
        s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        cr_assert_eq(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
        socklen_t len = sizeof a;
        getsockname(s->listen_fd, (struct sockaddr *)&a, &len);
        s->port = ntohs(a.sin_port);
    } else {
        snprintf(s->path, sizeof s->path, "/tmp/kvmatch-test-client-%d-%u.sock", (int)getpid(),
                 (unsigned)(km_test_seed() % 100000));
        unlink(s->path);
        s->listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        snprintf(a.sun_path, sizeof a.sun_path, "%s", s->path);
        cr_assert_eq(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0, "bind %s", s->path);
    }
    cr_assert_eq(listen(s->listen_fd, 16), 0);
    cr_assert_eq(pthread_create(&s->thread, NULL, fake_main, s), 0);
}

static void fake_address(const fake_server *s, char *out, size_t cap)
{
    if (s->port)
        snprintf(out, cap, "tcp:127.0.0.1:%u", s->port);
    else
        snprintf(out, cap, "unix:%s", s->path);
}

static void fake_stop(fake_server *s)
{
    shutdown(s->listen_fd, SHUT_RDWR);
    close(s->listen_fd);
    pthread_join(s->thread, NULL);
    if (s->path[0])
        unlink(s->path);
}

static km_client *connect_ok(const fake_server *s)
{
    char address[160], why[256];
    fake_address(s, address, sizeof address);
    km_client *c = NULL;
    int rc = km_client_connect(address, 5000, &c, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "connect %s: %s", address, why);
    return c;
}

/* ---- tests --------------------------------------------------------------------------------------- */

static void make_route(km_route_request *q, char *id_buf, size_t cap, uint32_t i, uint64_t *hashes,
                       uint32_t n_hashes)
{
    memset(q, 0, sizeof *q);
    snprintf(id_buf, cap, "req-%u", i);
    q->request_id = id_buf;
    q->attempt_id = "0";
    q->input = KM_ROUTE_INPUT_HASHES;
    q->hashes = hashes;
    q->n_hashes = n_hashes;
}

static void check_decision(const km_route_decision *d, const km_route_request *q, uint32_t index,
                           uint64_t msg_id)
{
    KM_CHECK(d->status == KM_OK, "decision failed: %s", d->message);
    KM_CHECK(strcmp(d->request_id, q->request_id) == 0, "request_id %s for %s", d->request_id,
             q->request_id);
    KM_CHECK(d->decision_id == msg_id * 1000 + index, "decision_id %llu",
             (unsigned long long)d->decision_id);
    KM_CHECK(d->chosen_worker == fake_choice(q, index), "chosen %u, expected %u", d->chosen_worker,
             fake_choice(q, index));
    KM_CHECK(d->has_owner && d->owner_worker == (d->chosen_worker + 1) % 7, "owner");
    KM_CHECK(d->source == KM_PREDICTION_EVENTS, "source");
    KM_CHECK(d->n_candidates == 1 && d->candidates[0].worker == d->chosen_worker, "candidates");
}

Test(client, blocking_route_unix_and_tcp, .timeout = 20)
{
    for (int tcp = 0; tcp < 2; tcp++) {
        fake_server s;
        fake_start(&s, FAKE_NORMAL, tcp);
        km_client *c = connect_ok(&s);
        const km_welcome *w = km_client_welcome(c);
        cr_assert_eq(w->protocol_version, KM_PROTOCOL_VERSION);
        cr_assert_str_eq(w->kvmatch_version, "0.1.0-fake");
        cr_assert_str_eq(w->server_name, "fake");
        cr_assert_eq(w->limits.max_frame_bytes, KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES);
        cr_assert_geq(km_client_fd(c), 0);

        km_rng r;
        km_rng_init(&r, km_test_seed());
        enum { N = 5 };
        km_route_request q[N];
        char ids[N][32];
        uint64_t hashes[N][20];
        for (uint32_t i = 0; i < N; i++) {
            for (int k = 0; k < 20; k++)
                hashes[i][k] = km_rng_hash(&r);
            make_route(&q[i], ids[i], sizeof ids[i], i, hashes[i], 1 + km_rng_below(&r, 20));
        }
        km_message reply;
        cr_assert_eq(km_client_route(c, q, N, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
        cr_assert_eq(reply.type, KM_MESSAGE_DECISION);
        cr_assert_eq(reply.decision.n_decisions, N);
        for (uint32_t i = 0; i < N; i++)
            check_decision(&reply.decision.decisions[i], &q[i], i, reply.id);
        cr_assert_str_eq(reply.decision.kvmatch_version, "0.1.0-fake");
        cr_assert_eq(km_client_outstanding(c), 0);

        /* An ERROR reply makes the blocking call return its code, with the server's words. */
        cr_assert_eq(km_client_status(c, 5000, &reply), KM_ERR_SHUTTING_DOWN);
        cr_assert_eq(reply.type, KM_MESSAGE_ERROR);
        cr_assert(strstr(km_client_last_error(c), "draining"), "%s", km_client_last_error(c));
        /* ... and the connection stays usable. */
        cr_assert_eq(km_client_route(c, q, 1, 5000, &reply), KM_OK);
        km_client_close(c);
        fake_stop(&s);
    }
}

Test(client, pipelined_out_of_order, .timeout = 30)
{
    fake_server s;
    fake_start(&s, FAKE_REVERSE, false);
    km_client *c = connect_ok(&s);
    km_rng r;
    km_rng_init(&r, km_test_seed());
    enum { N = 64 };
    km_route_request q[N];
    char ids[N][32];
    uint64_t hashes[N][8];
    uint64_t sent[N];
    for (uint32_t i = 0; i < N; i++) {
        for (int k = 0; k < 8; k++)
            hashes[i][k] = km_rng_hash(&r);
        make_route(&q[i], ids[i], sizeof ids[i], i, hashes[i], 1 + km_rng_below(&r, 8));
        cr_assert_eq(km_client_send_route(c, &q[i], 1, 5000, &sent[i]), KM_OK, "%s",
                     km_client_last_error(c));
    }
    cr_assert_eq(km_client_outstanding(c), N);
    /* The first half by id, in send order: the server sends groups of 8 reversed, so most wanted
     * replies arrive after others, which must be kept. */
    for (uint32_t i = 0; i < N / 2; i++) {
        km_message reply;
        cr_assert_eq(km_client_wait(c, sent[i], 5000, &reply), KM_OK, "%s", km_client_last_error(c));
        cr_assert_eq(reply.id, sent[i]);
        cr_assert_eq(reply.decision.n_decisions, 1);
        check_decision(&reply.decision.decisions[0], &q[i], 0, sent[i]);
    }
    /* The rest in whatever order they come. */
    bool seen[N] = {false};
    for (uint32_t k = N / 2; k < N; k++) {
        km_message reply;
        cr_assert_eq(km_client_receive(c, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
        uint32_t i = 0;
        while (i < N && sent[i] != reply.id)
            i++;
        cr_assert(i >= N / 2 && i < N && !seen[i], "unexpected reply id %llu",
                  (unsigned long long)reply.id);
        seen[i] = true;
        check_decision(&reply.decision.decisions[0], &q[i], 0, sent[i]);
    }
    cr_assert_eq(km_client_outstanding(c), 0);
    km_message reply;
    cr_assert_eq(km_client_receive(c, 100, &reply), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_client_wait(c, sent[0], 100, &reply), KM_ERR_NOT_FOUND);
    km_client_close(c);
    fake_stop(&s);
}

/* An id whose reply was returned, or that was never sent, is answered KM_ERR_NOT_FOUND at once,
 * while replies kept for other ids stay kept. */
Test(client, wait_on_an_id_not_outstanding, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_REVERSE, false); /* groups of 8, the last sent first */
    km_client *c = connect_ok(&s);
    enum { N = 8 };
    km_route_request q[N];
    char ids[N][32];
    uint64_t hashes[N][2];
    uint64_t sent[N];
    for (uint32_t i = 0; i < N; i++) {
        hashes[i][0] = 100 + i;
        hashes[i][1] = 200 + i;
        make_route(&q[i], ids[i], sizeof ids[i], i, hashes[i], 2);
        cr_assert_eq(km_client_send_route(c, &q[i], 1, 5000, &sent[i]), KM_OK);
    }
    km_message reply;
    /* Waiting for the first reads all eight: the other seven are kept. */
    cr_assert_eq(km_client_wait(c, sent[0], 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    check_decision(&reply.decision.decisions[0], &q[0], 0, sent[0]);
    cr_assert_eq(km_client_outstanding(c), N - 1);
    /* The same id again, with no limit on the wait: nothing more can come for it, so the answer
     * is at once (a wait for it would never return: the test's timeout). */
    int rc = km_client_wait(c, sent[0], -1, &reply);
    cr_assert_eq(rc, KM_ERR_NOT_FOUND, "%s", km_error_name(rc));
    cr_assert(strstr(km_client_last_error(c), "not waiting"), "%s", km_client_last_error(c));
    /* Ids never sent: 0, the handshake's, one past the last. */
    cr_assert_eq(km_client_wait(c, 0, -1, &reply), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_client_wait(c, sent[0] - 1, -1, &reply), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_client_wait(c, sent[N - 1] + 1, -1, &reply), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_client_outstanding(c), N - 1);
    /* The kept replies, out of order, each still its own. */
    for (uint32_t i = N - 1; i >= 1; i--) {
        cr_assert_eq(km_client_wait(c, sent[i], 5000, &reply), KM_OK, "%s",
                     km_client_last_error(c));
        cr_assert_eq(reply.id, sent[i]);
        check_decision(&reply.decision.decisions[0], &q[i], 0, sent[i]);
        cr_assert_eq(km_client_wait(c, sent[i], -1, &reply), KM_ERR_NOT_FOUND);
    }
    cr_assert_eq(km_client_outstanding(c), 0);
    /* Requests sent from there on are tracked as before. */
    uint64_t one, two;
    cr_assert_eq(km_client_send_route(c, &q[1], 1, 5000, &one), KM_OK);
    cr_assert_eq(km_client_send_route(c, &q[2], 1, 5000, &two), KM_OK);
    cr_assert_eq(km_client_outstanding(c), 2);
    km_client_close(c);
    fake_stop(&s);
}

/* A second reply to one request breaks the pairing of replies with requests: the connection is
 * closed rather than the reply kept for an id nobody waits on. */
Test(client, reply_to_an_id_not_outstanding, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_ROUTE_TWICE, false);
    km_client *c = connect_ok(&s);
    uint64_t h[1] = {9};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 1);
    km_message reply;
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    uint64_t first = reply.id;
    int rc = km_client_route(c, &q, 1, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    char expected[64];
    snprintf(expected, sizeof expected, "answered request %llu", (unsigned long long)first);
    cr_assert(strstr(km_client_last_error(c), expected), "%s", km_client_last_error(c));
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    fake_stop(&s);
}

/* A DECISION holds one decision per route and an ACK one item per event (client.h): a reply whose
 * count differs is refused (final), blocking or pipelined, so a caller that reads decisions[i] for
 * route i never reads past the array. */
Test(client, reply_item_count_differs_from_the_request, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_MISCOUNT, false);
    uint64_t h[1] = {9};
    km_route_request q[2];
    char id[2][32];
    make_route(&q[0], id[0], sizeof id[0], 0, h, 1);
    make_route(&q[1], id[1], sizeof id[1], 1, h, 1);
    km_message reply;

    km_client *c = connect_ok(&s);
    int rc = km_client_route(c, q, 2, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert(strstr(km_client_last_error(c), "1 decision for 2 routes"), "%s",
              km_client_last_error(c));
    cr_assert_eq(km_client_route(c, q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);

    c = connect_ok(&s); /* pipelined, and a DECISION with no decision at all */
    uint64_t sent;
    cr_assert_eq(km_client_send_route(c, q, 1, 5000, &sent), KM_OK);
    rc = km_client_receive(c, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert(strstr(km_client_last_error(c), "0 decisions for 1 route"), "%s",
              km_client_last_error(c));
    km_client_close(c);

    c = connect_ok(&s);
    km_lifecycle_event ev = {.kind = KM_LIFECYCLE_DISPATCHED, .has_decision_id = true,
                             .decision_id = 1};
    rc = km_client_lifecycle(c, &ev, 1, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert(strstr(km_client_last_error(c), "2 items for 1 event"), "%s",
              km_client_last_error(c));
    km_client_close(c);
    fake_stop(&s);
}

/* A connection-level ERROR (id 0) means the server closes the connection, whatever code it
 * carries: the call fails with KM_ERR_CLOSED (final), the server's code and words in
 * km_client_last_error. The server's code is not returned as is: a KM_ERR_TIMEOUT would answer
 * what client.h says leaves the connection usable, on a closed handle. */
Test(client, a_connection_level_error_is_final_whatever_its_code, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_CONNECTION_ERROR, false);
    uint64_t h[1] = {9};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 1);
    km_message reply;

    km_client *c = connect_ok(&s);
    int rc = km_client_route(c, &q, 1, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_CLOSED, "%s: %s", km_error_name(rc), km_client_last_error(c));
    const char *why = km_client_last_error(c);
    cr_assert(strstr(why, "KM_ERR_TIMEOUT") && strstr(why, "fake server gives up"), "%s", why);
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);

    c = connect_ok(&s); /* pipelined */
    uint64_t sent;
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &sent), KM_OK);
    rc = km_client_receive(c, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_CLOSED, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert_eq(km_client_wait(c, sent, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    fake_stop(&s);
}

/* Each request has its reply type (docs/PROTOCOL.md, "Messages"), or ERROR: a reply of another
 * type is refused (final), pipelined as blocking: km_client_receive does not return a ROUTE's
 * STATUS_REPLY with KM_OK, and a blocking call that refuses it closes the connection. */
Test(client, reply_of_the_wrong_type_for_its_request, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_WRONG_TYPE, false);
    uint64_t h[1] = {9};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 1);
    km_message reply;

    km_client *c = connect_ok(&s);
    uint64_t sent;
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &sent), KM_OK);
    int rc = km_client_receive(c, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert(strstr(km_client_last_error(c), "ROUTE") &&
                  strstr(km_client_last_error(c), "STATUS_REPLY"),
              "%s", km_client_last_error(c));
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &sent), KM_ERR_CLOSED);
    km_client_close(c);

    c = connect_ok(&s); /* blocking */
    rc = km_client_route(c, &q, 1, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    fake_stop(&s);
}

/* WELCOME answers HELLO: one with another id is refused, not taken. */
Test(client, welcome_to_another_id, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_WELCOME_WRONG_ID, false);
    char address[160], why[256];
    fake_address(&s, address, sizeof address);
    km_client *c = NULL;
    int rc = km_client_connect(address, 5000, &c, why, sizeof why);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), why);
    cr_assert(strstr(why, "WELCOME"), "%s", why);
    cr_assert_null(c);
    km_client_close(c);
    fake_stop(&s);
}

/* The server words a request it cannot decode as its decoder does, "KM_ERR_TOO_LARGE: routes: ...";
 * km_client_last_error names the code once, not "KM_ERR_TOO_LARGE: KM_ERR_TOO_LARGE: routes:
 * ...". */
Test(client, server_error_named_once, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_ONE_ROUTE, false);
    uint64_t h[1] = {9};
    km_route_request q[2];
    char id[2][32];
    make_route(&q[0], id[0], sizeof id[0], 0, h, 1);
    make_route(&q[1], id[1], sizeof id[1], 1, h, 1);
    km_message reply;
    km_client *c = connect_ok(&s);
    int rc = km_client_route(c, q, 2, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_TOO_LARGE, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ERROR);
    cr_assert(strncmp(reply.error.message, "KM_ERR_TOO_LARGE: routes", 24) == 0, "%s",
              reply.error.message); /* the premise: the server's own words */
    cr_assert(strncmp(km_client_last_error(c), "KM_ERR_TOO_LARGE: routes", 24) == 0, "%s",
              km_client_last_error(c));
    cr_assert_eq(km_client_route(c, q, 1, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    km_client_close(c);
    fake_stop(&s);
}

/* km_client_outstanding counts the requests whose reply can still be returned: after a final
 * error, only those whose reply was kept, not every request sent, so a caller draining replies
 * until it reaches 0 gets there. */
Test(client, outstanding_after_a_final_error, .timeout = 20)
{
    uint64_t h[1] = {9};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 1);
    km_message reply;
    uint64_t a, b;

    fake_server s;
    fake_start(&s, FAKE_MISCOUNT, false); /* the first reply is final */
    km_client *c = connect_ok(&s);
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &a), KM_OK);
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &b), KM_OK);
    cr_assert_eq(km_client_outstanding(c), 2);
    int rc = km_client_receive(c, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert_eq(km_client_outstanding(c), 0);
    km_client_close(c);
    fake_stop(&s);

    /* Replies A, A, B, B: waiting for B keeps A, then A's second reply is final. */
    fake_start(&s, FAKE_ROUTE_TWICE, false);
    c = connect_ok(&s);
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &a), KM_OK);
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &b), KM_OK);
    rc = km_client_wait(c, b, 5000, &reply);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "%s: %s", km_error_name(rc), km_client_last_error(c));
    cr_assert_eq(km_client_outstanding(c), 1, "%u", km_client_outstanding(c));
    cr_assert_eq(km_client_receive(c, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.id, a);
    cr_assert_eq(km_client_outstanding(c), 0);
    cr_assert_eq(km_client_receive(c, 5000, &reply), KM_ERR_CLOSED);
    cr_assert_eq(km_client_wait(c, b, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    fake_stop(&s);
}

Test(client, lifecycle_ack_per_event, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_NORMAL, false);
    km_client *c = connect_ok(&s);
    km_lifecycle_event ev[3] = {0};
    ev[0].kind = KM_LIFECYCLE_DISPATCHED;
    ev[0].has_decision_id = true;
    ev[0].decision_id = 42;
    ev[1].kind = KM_LIFECYCLE_FINISHED;
    ev[1].request_id = "r1";
    ev[1].outcome = KM_OUTCOME_COMPLETE; /* without finish_reason / [DONE]: refused per event */
    ev[2].kind = KM_LIFECYCLE_FINISHED;
    ev[2].request_id = "r2";
    ev[2].finish_reason = "stop";
    ev[2].done_seen = true;
    ev[2].has_cached_tokens = true;
    ev[2].cached_tokens = 512;
    km_message reply;
    cr_assert_eq(km_client_lifecycle(c, ev, 3, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    cr_assert_eq(reply.ack.n_items, 3);
    cr_assert_eq(reply.ack.items[0].status, KM_OK);
    cr_assert_eq(reply.ack.items[1].status, KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(reply.ack.items[1].message, "outcome"), "%s", reply.ack.items[1].message);
    cr_assert_eq(reply.ack.items[2].status, KM_OK);

    /* Encoding errors are caught before anything is sent. */
    km_lifecycle_event bad = {.kind = KM_LIFECYCLE_DISPATCHED}; /* no decision_id, no request_id */
    cr_assert_eq(km_client_lifecycle(c, &bad, 1, 5000, &reply), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(km_client_last_error(c), "decision_id"), "%s", km_client_last_error(c));
    cr_assert_eq(km_client_outstanding(c), 0);
    cr_assert_eq(km_client_lifecycle(c, ev, 1, 5000, &reply), KM_OK);
    km_client_close(c);
    fake_stop(&s);
}

Test(client, connect_errors, .timeout = 20)
{
    km_client *c = (km_client *)1;
    char why[256];
    cr_assert_eq(km_client_connect("unix:/tmp/kvmatch-test-no-such-socket", 1000, &c, why, sizeof why),
                 KM_ERR_IO);
    cr_assert_null(c);
    cr_assert(strstr(why, "connect"), "%s", why);
    cr_assert_eq(km_client_connect("http://x", 1000, &c, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_client_connect("tcp:localhost:80", 1000, &c, why, sizeof why),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_client_connect("tcp:127.0.0.1:0", 1000, &c, why, sizeof why),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_client_connect(NULL, 1000, &c, why, sizeof why), KM_ERR_NULL_POINTER);

    fake_server s;
    fake_start(&s, FAKE_REFUSE_HELLO, false);
    char address[160];
    fake_address(&s, address, sizeof address);
    cr_assert_eq(km_client_connect(address, 5000, &c, why, sizeof why), KM_ERR_INCOMPATIBLE);
    cr_assert(strstr(why, "protocol 1 only"), "%s", why);
    cr_assert_null(c);
    fake_stop(&s);
}

static void *fake_main_after_200ms(void *arg)
{
    nanosleep(&(struct timespec){0, 200000000L}, NULL);
    return fake_main(arg);
}

/* A Unix server whose listen queue is full refuses connect with EAGAIN: the client tries again
 * within its timeout, as a blocking connect would wait, and says so when the queue stays full. */
Test(client, connect_waits_while_the_listen_queue_is_full, .timeout = 20)
{
    fake_server s;
    memset(&s, 0, sizeof s);
    s.mode = FAKE_NORMAL;
    snprintf(s.path, sizeof s.path, "/tmp/kvmatch-test-client-queue-%d.sock", (int)getpid());
    unlink(s.path);
    s.listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", s.path);
    cr_assert_eq(bind(s.listen_fd, (struct sockaddr *)&a, sizeof a), 0, "bind %s", s.path);
    cr_assert_eq(listen(s.listen_fd, 0), 0); /* room for one connection not yet accepted */
    int queued = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_eq(connect(queued, (struct sockaddr *)&a, sizeof a), 0);
    close(queued); /* still queued: the fake server accepts it, reads EOF, and goes on */
    char address[160], why[256];
    fake_address(&s, address, sizeof address);
    km_client *c = NULL;

    double t0 = km_test_now();
    int rc = km_client_connect(address, 300, &c, why, sizeof why);
    double took = km_test_now() - t0;
    cr_assert_eq(rc, KM_ERR_TIMEOUT, "%s: %s", km_error_name(rc), why);
    cr_assert(strstr(why, "listen queue"), "%s", why);
    /* It kept trying for its timeout; the upper bound (30 times the timeout) only catches a
     * connect that ignores its timeout, which the test's timeout would also catch. */
    cr_assert(took >= 0.25 && took < 10.0, "connect took %.3f s for a timeout of 0.3 s", took);
    cr_assert_null(c);

    cr_assert_eq(pthread_create(&s.thread, NULL, fake_main_after_200ms, &s), 0);
    rc = km_client_connect(address, 5000, &c, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "%s: %s", km_error_name(rc), why);
    km_client_close(c);
    fake_stop(&s);
}

Test(client, timeout_then_usable_and_close, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_SILENT_ROUTE, false);
    km_client *c = connect_ok(&s);
    uint64_t h[2] = {11, 12};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 2);
    km_message reply;
    double t0 = km_test_now();
    cr_assert_eq(km_client_route(c, &q, 1, 200, &reply), KM_ERR_TIMEOUT);
    double waited = km_test_now() - t0;
    /* it waited for its timeout; the upper bound (50 times it) only catches a wait that ignores
     * its timeout */
    cr_assert(waited >= 0.15 && waited < 10.0, "timeout took %.3f s", waited);
    /* The connection is still usable for other requests. */
    km_lifecycle_event ev = {.kind = KM_LIFECYCLE_DISPATCHED, .has_decision_id = true, .decision_id = 1};
    cr_assert_eq(km_client_lifecycle(c, &ev, 1, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    km_client_close(c);
    fake_stop(&s);

    /* The server closes the connection: KM_ERR_CLOSED, and the handle stays closed. */
    fake_start(&s, FAKE_CLOSE_ON_ROUTE, false);
    c = connect_ok(&s);
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED, "%s", km_client_last_error(c));
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    km_client_close(NULL);
    fake_stop(&s);
}

/* A blocking call that timed out gives its request up: the late reply is read and dropped, not
 * kept for a wait that never comes (a kept one would be a leak for a user of the blocking calls
 * only), and the request no longer counts as outstanding. A km_client_wait that timed out is not
 * given up: it may be retried. */
Test(client, a_blocking_call_that_timed_out_drops_its_late_reply, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_LATE_ROUTE, false);
    km_client *c = connect_ok(&s);
    uint64_t h[2] = {11, 12};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 2);
    km_message reply;
    cr_assert_eq(km_client_route(c, &q, 1, 100, &reply), KM_ERR_TIMEOUT);
    cr_assert_eq(km_client_outstanding(c), 0, "a given-up call still counts as outstanding");
    /* The late DECISION arrives before this ACK: dropped, not kept, not a protocol error. */
    km_lifecycle_event ev = {.kind = KM_LIFECYCLE_DISPATCHED, .has_decision_id = true, .decision_id = 1};
    cr_assert_eq(km_client_lifecycle(c, &ev, 1, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(km_client_outstanding(c), 0);
    cr_assert_eq(km_client_receive(c, 100, &reply), KM_ERR_INVALID_ARGUMENT,
                 "a reply was kept for the given-up call");
    /* The same through km_client_receive: a pipelined request after a given-up one. */
    cr_assert_eq(km_client_route(c, &q, 1, 100, &reply), KM_ERR_TIMEOUT);
    uint64_t sent;
    cr_assert_eq(km_client_send_lifecycle(c, &ev, 1, 5000, &sent), KM_OK);
    cr_assert_eq(km_client_receive(c, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_ACK);
    cr_assert_eq(reply.id, sent);
    /* A wait that timed out stays waiting: its reply is still delivered. */
    uint64_t route_id;
    cr_assert_eq(km_client_send_route(c, &q, 1, 5000, &route_id), KM_OK);
    cr_assert_eq(km_client_wait(c, route_id, 100, &reply), KM_ERR_TIMEOUT);
    cr_assert_eq(km_client_wait(c, route_id, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply.type, KM_MESSAGE_DECISION);
    km_client_close(c);
    fake_stop(&s);
}

/* The frame size the server announced stays the client's hard bound: a reply over it is refused
 * (final), though the client's own default would take it. */
Test(client, reply_over_the_announced_frame_size, .timeout = 20)
{
    fake_server s;
    fake_start(&s, FAKE_SMALL_FRAMES, false);
    km_client *c = connect_ok(&s);
    cr_assert_eq(km_client_welcome(c)->limits.max_frame_bytes, FAKE_SMALL_FRAME_BYTES);
    uint64_t h[1] = {5};
    km_route_request q;
    char id[32];
    make_route(&q, id, sizeof id, 0, h, 1);
    km_message reply;
    /* One route: its DECISION fits in the announced frame. */
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_OK, "%s", km_client_last_error(c));
    check_decision(&reply.decision.decisions[0], &q, 0, reply.id);
    /* Sixteen: the ROUTE fits, its DECISION (about 250 bytes a route) does not. */
    enum { N = 16 };
    km_route_request qs[N];
    for (uint32_t i = 0; i < N; i++)
        qs[i] = q;
    cr_assert_eq(km_client_route(c, qs, N, 5000, &reply), KM_ERR_TOO_LARGE, "%s",
                 km_client_last_error(c));
    cr_assert(strstr(km_client_last_error(c), "max_frame_bytes is 1024"), "%s",
              km_client_last_error(c));
    cr_assert_eq(km_client_route(c, &q, 1, 5000, &reply), KM_ERR_CLOSED);
    km_client_close(c);
    fake_stop(&s);
}

/* ---- against the real server ------------------------------------------------------------------- */

typedef struct real_server {
    km_server *server;
    pthread_t thread;
    int run_status;
    char dir[64];
    char sock[128];
    char address[160];
    km_server_pool pool; /* the config's strings and arrays, kept for the server's life */
} real_server;

static void *real_main(void *arg)
{
    real_server *r = arg;
    r->run_status = km_server_run(r->server, false);
    return NULL;
}

static void real_quiet_log(void *user, const char *line)
{
    (void)user;
    (void)line;
}

/* `kvmatch serve` in a thread on a socket in a fresh directory: one pool "main" (block size 4,
 * policy kv) of `n_workers` approximate-mode workers, CPU backend, no records. */
static void real_start(real_server *r, km_server_worker *workers, uint32_t n_workers)
{
    memset(r, 0, sizeof *r);
    strcpy(r->dir, "/tmp/kvmatch-client-XXXXXX");
    cr_assert_not_null(mkdtemp(r->dir));
    snprintf(r->sock, sizeof r->sock, "%s/s.sock", r->dir);
    snprintf(r->address, sizeof r->address, "unix:%s", r->sock);
    for (uint32_t i = 0; i < n_workers; i++)
        workers[i] = (km_server_worker){.id = i};
    r->pool = (km_server_pool){.name = "main", .block_size = 4, .workers = workers,
                               .n_workers = n_workers};
    km_policy_config_init(&r->pool.policy);
    r->pool.policy.kind = KM_POLICY_KV;
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = r->sock;
    cfg.records_path = NULL;
    cfg.max_workers = n_workers;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.log = real_quiet_log;
    cfg.max_queue_wait_ms = 0; /* wall-time shedding is tested in test_server.c */
    cfg.pools = &r->pool;
    cfg.n_pools = 1;
    char why[256];
    int rc = km_server_create(&cfg, &r->server, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_server_create: %s: %s", km_error_name(rc), why);
    cr_assert_eq(pthread_create(&r->thread, NULL, real_main, r), 0);
}

static void real_stop(real_server *r)
{
    km_server_stop(r->server);
    pthread_join(r->thread, NULL);
    cr_assert_eq(r->run_status, KM_OK, "km_server_run: %s", km_error_name(r->run_status));
    km_server_destroy(r->server);
    unlink(r->sock);
    rmdir(r->dir);
}

/* A ROUTE within every limit the server announces (max_batch_items routes) to a pool of 90
 * workers: the DECISION holds 4096 * 90 candidate rows, over 4.4 million msgpack values, more than
 * the default max_objects, in fewer than max_frame_bytes. The client must read it. */
Test(client, reads_the_largest_decision_the_server_sends, .timeout = 60)
{
    enum { WORKERS = 90 };
    static km_server_worker workers[WORKERS];
    real_server r;
    real_start(&r, workers, WORKERS);
    km_client *c = NULL;
    char why[256];
    int rc = km_client_connect(r.address, 5000, &c, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "connect: %s: %s", km_error_name(rc), why);
    const km_protocol_limits *announced = &km_client_welcome(c)->limits;
    km_protocol_limits defaults;
    km_protocol_limits_init(&defaults);
    cr_assert_eq(announced->max_objects, defaults.max_objects);
    uint32_t n = announced->max_batch_items;
    cr_assert_eq(n, 4096);
    static char ids[4096][16];
    static uint32_t tokens[4096][4];
    static km_route_request q[4096];
    for (uint32_t k = 0; k < n; k++) {
        snprintf(ids[k], sizeof ids[k], "r-%u", k);
        for (uint32_t t = 0; t < 4; t++)
            tokens[k][t] = 1000 + 4 * k + t;
        memset(&q[k], 0, sizeof q[k]);
        q[k].request_id = ids[k];
        q[k].pool = "main";
        q[k].input = KM_ROUTE_INPUT_TOKENS;
        q[k].tokens = tokens[k];
        q[k].n_tokens = 4;
    }
    km_message reply;
    double t0 = km_test_now();
    rc = km_client_route(c, q, n, 60000, &reply);
    cr_assert_eq(rc, KM_OK, "route: %s: %s", km_error_name(rc), km_client_last_error(c));
    fprintf(stderr, "client: a DECISION of %u x %u candidates in %.2f s\n", n, WORKERS,
            km_test_now() - t0);
    cr_assert_eq(reply.decision.n_decisions, n);
    uint64_t values = 0;
    for (uint32_t k = 0; k < n; k++) {
        const km_route_decision *d = &reply.decision.decisions[k];
        cr_assert_eq(d->status, KM_OK, "route %u: %s", k, d->message);
        cr_assert_str_eq(d->request_id, ids[k]);
        cr_assert_eq(d->n_candidates, WORKERS);
        cr_assert_lt(d->chosen_worker, WORKERS);
        values += 12u * d->n_candidates;
    }
    cr_assert_gt(values, defaults.max_objects);
    /* The connection is still in service. */
    rc = km_client_route(c, q, 1, 5000, &reply);
    cr_assert_eq(rc, KM_OK, "route after: %s: %s", km_error_name(rc), km_client_last_error(c));
    km_client_close(c);
    real_stop(&r);
}
