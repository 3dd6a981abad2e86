/* The km_cluster handle (include/kvmatch/cluster.h): one NATS connection (libnats), one wildcard
 * subscription to the cluster's subjects (so every message of a peer arrives in the order it was
 * sent), this instance's published loads, the remote contributions and their per-worker sum, the
 * heartbeat thread, which makes the heartbeat states and the states answering the peers' sync
 * requests, and the publisher thread. One mutex guards everything, and no NATS call is made under
 * it (a server that stops reading blocks a NATS call, never a decision): a message is numbered and
 * encoded under it into the outbox, a bounded queue that the publisher thread hands to the NATS
 * client in order outside it. A message that finds the outbox full is dropped and counted, its
 * sequence number spent, so the peers see the gap. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nats/nats.h>

#include "base/log_level.h"
#include "base/u64_map.h"
#include "base/utf8.h"
#include "base/error_detail.h"
#include "cluster/cluster_internal.h"

#define NS_PER_MS UINT64_C(1000000)
/* A refusal is logged when its reason was not logged within this interval; the ones in between
 * are counted and the next line says how many there were. */
#define KM_CLUSTER_REFUSAL_LOG_NS (UINT64_C(10000) * NS_PER_MS)
/* How long destroy waits for the NATS client to report its subscription and connection closed. */
#define KM_CLUSTER_CLOSE_WAIT_MS 10000
/* The outbox's bounds: past either, a new message is dropped (counted in publish_failures). A
 * burst of decisions queues faster than the publisher drains only briefly; a server that takes
 * nothing fills it within KM_CLUSTER_WRITE_DEADLINE_MS or so. */
#define KM_CLUSTER_OUTBOX_MAX_MESSAGES 65536u /* the default and largest outbox_max_messages */
#define KM_CLUSTER_OUTBOX_MAX_BYTES (16u * 1024u * 1024u)
/* A write to a server that stops reading fails after this long, and the client reconnects. */
#define KM_CLUSTER_WRITE_DEADLINE_MS 500
/* A server that answers no PING for KM_CLUSTER_MAX_PINGS_OUT intervals is treated as lost. */
#define KM_CLUSTER_PING_INTERVAL_MS 1000
#define KM_CLUSTER_MAX_PINGS_OUT 3

/* At most one line per interval for a recurring event; the next line says how many were not
 * logged in between. */
typedef struct log_limit {
    uint64_t logged_ns; /* the last line; 0 = never */
    uint64_t unlogged;  /* events since that line */
} log_limit;

/* One encoded message waiting in the outbox. */
typedef struct outgoing {
    char *subject;    /* malloc'd: the subject, its NUL, then the body */
    const char *body; /* inside `subject`'s allocation */
    size_t length;    /* the body's */
    cluster_kind kind;
    uint64_t seq;
    bool answers_sync; /* a state that answers the sync requests received before it */
} outgoing;

/* One worker's in-flight work as one instance last said it (cluster_worker_work without the id). */
typedef struct held_work {
    uint64_t *prefixes; /* malloc'd; NULL when none */
    uint32_t n_prefixes;
    uint64_t *queued;   /* malloc'd; NULL when none */
    uint32_t n_queued;
} held_work;

typedef struct contribution {
    bool used;
    bool has_baseline; /* a full state was applied (else only changes: stale) */
    bool stale;        /* a gap, no baseline yet, or NATS disconnected since its last state */
    bool answered_sync; /* sent a state since this handle's last sync request */
    char id[KM_CLUSTER_INSTANCE_MAX + 1];
    uint64_t incarnation;
    uint64_t last_seq;
    uint64_t last_heard_ns;
    km_active_load *loads; /* max_workers of them */
    held_work *work;       /* max_workers of them */
    cluster_pool_fingerprint *pools; /* KM_CLUSTER_MAX_POOLS: its last state's pool list */
    uint32_t n_pools;
    /* Bit i: this instance's pool i (local_pools) has another fingerprint there: the peer's load
     * on that pool's workers is left out of the remote sum, its predictions for it refused. */
    uint64_t mismatch;
} contribution;

struct km_cluster {
    km_cluster_config cfg;
    char *url, *instance, *prefix;
    char url_shown[256]; /* km_cluster_url_shown: what logs and messages say */
    size_t prefix_len;
    uint64_t incarnation;

    pthread_mutex_t lock;
    pthread_cond_t cond; /* sync answers (both ways), heartbeat stop */
    natsOptions *opts;
    natsConnection *conn;
    natsSubscription *sub;
    bool connected, synced, closing;
    bool nats_closed; /* the client's closed callback ran: no callback of it comes after */
    bool sub_watched;  /* on_subscription_complete is set on sub */
    log_limit refusal_log[KM_CLUSTER_REFUSAL_COUNT]; /* per reason */
    log_limit publish_failure_log;
    log_limit gap_log; /* sequence gaps, all peers */
    log_limit nats_error_log; /* the NATS client's asynchronous errors */
    bool sub_complete; /* the subscription is closed and its message handler has returned */
    int callbacks_running;

    uint64_t seq;
    uint64_t sent_seq;     /* the last change or state handed to the outbox */

    /* The outbox: a ring of outbox_count messages from outbox_head, outbox_bytes of bodies; the
     * publisher thread takes them in order. outbox_done counts the messages it took. */
    pthread_cond_t outbox_cond; /* a message queued, or closing */
    outgoing *outbox;           /* cfg.outbox_max_messages */
    uint32_t outbox_head, outbox_count;
    size_t outbox_bytes;
    uint64_t outbox_queued, outbox_done;
    uint64_t changes_made; /* for drop_one_in */
    km_active_load *local;  /* max_workers: this instance's last published loads */
    km_active_load *remote; /* max_workers: the sum over contributions */
    held_work *local_work;  /* max_workers: this instance's last published in-flight work */
    /* The remote in-flight work summed over contributions (as `remote`, leaving out mismatched
     * pools): work_slot(worker, prefix key) -> requests declaring it, work_slot(worker, block
     * hash) -> queued prefills promising it; remote_work_held counts the keys and hashes held. */
    km_memory work_memory;
    km_u64map remote_prefixes, remote_queued;
    uint64_t remote_work_held;
    bool work_omitted_logged;
    bool too_large_logged; /* a message over message_max was logged */
    /* The largest body sent: KM_CLUSTER_MESSAGE_MAX, or the server's max_payload when lower (it
     * refuses a larger one), as the last connect learnt it. */
    uint32_t message_max;
    contribution peers[KM_CLUSTER_MAX_INSTANCES];
    cluster_pool_fingerprint local_pools[KM_CLUSTER_MAX_POOLS]; /* km_cluster_set_pools */
    uint32_t n_local_pools;
    int8_t *worker_pool; /* max_workers: the local_pools index of each worker's pool, or -1 */

    /* sync bookkeeping (under lock) */
    bool sync_running;
    /* A peer's sync request arrived after the last state: the heartbeat thread publishes one at
     * last_state_ns + sync_answer_ms (at once when that has passed), and every state settles it. */
    bool sync_answer_due;
    uint64_t last_state_ns; /* the last state's attempt; 0 = none */
    char expected[KM_CLUSTER_MAX_INSTANCES][KM_CLUSTER_INSTANCE_MAX + 1];
    uint32_t n_expected;

    km_text subject, body;
    km_cluster_stats st;

    pthread_t heartbeat, publisher;
    bool heartbeat_started, publisher_started;
};

static void deadline_in(struct timespec *ts, uint64_t from_ns, uint64_t after_ns);

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static const char *const REFUSAL_NAMES[] = {
#define KM_CLUSTER_REFUSAL_NAME(value, name) name,
    KM_CLUSTER_REFUSAL_LIST(KM_CLUSTER_REFUSAL_NAME)
#undef KM_CLUSTER_REFUSAL_NAME
};
_Static_assert(sizeof REFUSAL_NAMES / sizeof REFUSAL_NAMES[0] == KM_CLUSTER_REFUSAL_COUNT,
               "KM_CLUSTER_REFUSAL_COUNT must count KM_CLUSTER_REFUSAL_LIST");

const char *km_cluster_refusal_name(km_cluster_refusal r)
{
    return (unsigned)r < KM_CLUSTER_REFUSAL_COUNT ? REFUSAL_NAMES[r] : "unknown";
}

/* One URL of a list (n bytes at url) into out[*at..size), its secret replaced. */
static void url_part_shown(const char *url, size_t n, char *out, size_t size, size_t *at)
{
    const char *end = url + n;
    const char *scheme_end = NULL;
    for (const char *p = url; p + 3 <= end && !scheme_end; p++)
        if (!memcmp(p, "://", 3))
            scheme_end = p;
    const char *host = scheme_end ? scheme_end + 3 : url;
    const char *authority_end = host;
    while (authority_end < end && !strchr("/?#", *authority_end))
        authority_end++;
    const char *userinfo_end = NULL; /* the last '@' of the authority (a password may hold '@') */
    for (const char *p = host; p < authority_end; p++)
        if (*p == '@')
            userinfo_end = p;
    int w;
    if (!userinfo_end) {
        w = snprintf(out + *at, size - *at, "%.*s", (int)n, url);
    } else {
        const char *colon = memchr(host, ':', (size_t)(userinfo_end - host));
        int user = colon ? (int)(colon - host) : 0; /* shown only where a password follows it */
        w = snprintf(out + *at, size - *at, "%.*s%.*s%s***%.*s", (int)(host - url), url, user, host,
                     colon ? ":" : "", (int)(end - userinfo_end), userinfo_end);
    }
    *at += w < 0 ? 0 : (size_t)w < size - *at ? (size_t)w : size - 1 - *at;
}

void km_cluster_url_shown(const char *url, char *out, size_t size)
{
    if (!out || size == 0)
        return;
    out[0] = '\0';
    if (!url)
        return;
    size_t at = 0;
    for (const char *p = url;;) { /* a comma-separated list of servers, each shown */
        size_t n = strcspn(p, ",");
        url_part_shown(p, n, out, size, &at);
        if (!p[n] || at + 1 >= size)
            break;
        out[at++] = ',';
        out[at] = '\0';
        p += n + 1;
    }
}

void km_cluster_config_init(km_cluster_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->subject_prefix = "kvmatch.cluster";
    cfg->max_workers = 1024;
    cfg->heartbeat_ms = 200;
    cfg->expire_ms = 1000;
    cfg->sync_timeout_ms = 2000;
    cfg->sync_quiet_ms = 100;
    cfg->sync_answer_ms = 20;
    cfg->reconnect_wait_ms = 200;
    cfg->outbox_max_messages = KM_CLUSTER_OUTBOX_MAX_MESSAGES;
}

static void cluster_log(km_cluster *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void cluster_log(km_cluster *c, const char *fmt, ...)
{
    if (!c->cfg.log)
        return;
    char line[512];
    size_t level = km_log_level_length(fmt);
    int n = snprintf(line, sizeof line, "%.*scluster %s: ", (int)level, fmt, c->instance);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt + level, ap);
    va_end(ap);
    c->cfg.log(c->cfg.log_user, line);
}

/* May a line about an event be logged now (lock held)? When not, the event is counted in
 * l->unlogged; when so, *more gets the events not logged since the last line. */
static bool log_limit_take(log_limit *l, uint64_t now, uint64_t *more)
{
    if (l->logged_ns && now - l->logged_ns < KM_CLUSTER_REFUSAL_LOG_NS) {
        l->unlogged++;
        return false;
    }
    *more = l->unlogged;
    l->logged_ns = now;
    l->unlogged = 0;
    return true;
}

/* ---- the remote sum ------------------------------------------------------------------------- */

/* Every field of `to` plus v's, UINT64_MAX past it (a local load may read UINT64_MAX already:
 * km_active_load's pending_prefill_pairs). */
static void load_add(km_active_load *to, const km_active_load *v)
{
#define ADD(f) to->f = to->f > UINT64_MAX - v->f ? UINT64_MAX : to->f + v->f
    ADD(in_flight);
    ADD(prefilling);
    ADD(pending_prefill_tokens);
    ADD(active_decode_blocks);
    ADD(allocated_blocks);
    ADD(pending_prefill_pairs);
#undef ADD
}

/* Every field of `to` minus v's, never below 0 (the sum holds each contribution's values, so a
 * clamp would mean a broken invariant). */
static void load_sub(km_active_load *to, const km_active_load *v)
{
#define SUB(f) to->f = to->f >= v->f ? to->f - v->f : 0
    SUB(in_flight);
    SUB(prefilling);
    SUB(pending_prefill_tokens);
    SUB(active_decode_blocks);
    SUB(allocated_blocks);
    SUB(pending_prefill_pairs);
#undef SUB
}

static bool load_equal(const km_active_load *a, const km_active_load *b)
{
    return a->in_flight == b->in_flight && a->prefilling == b->prefilling &&
           a->pending_prefill_tokens == b->pending_prefill_tokens &&
           a->active_decode_blocks == b->active_decode_blocks &&
           a->allocated_blocks == b->allocated_blocks &&
           a->pending_prefill_pairs == b->pending_prefill_pairs;
}

static bool load_zero(const km_active_load *a)
{
    static const km_active_load zero;
    return load_equal(a, &zero);
}

/* Is p's load on `worker` left out of the sum (its pool's fingerprints differ)? */
static bool excluded(const km_cluster *c, const contribution *p, uint32_t worker)
{
    int slot = c->worker_pool[worker];
    return slot >= 0 && (p->mismatch >> slot & 1u);
}

/* Set one worker of a contribution, keeping the sum. */
static void contribution_set(km_cluster *c, contribution *p, uint32_t worker,
                             const km_active_load *v)
{
    bool out = excluded(c, p, worker);
    if (!out)
        load_sub(&c->remote[worker], &p->loads[worker]);
    p->loads[worker] = *v;
    if (!out)
        load_add(&c->remote[worker], v);
}

/* ---- the remote in-flight work -------------------------------------------------------------- */

/* The map key of a prefix key or block hash on `worker` (the mixing km_active uses). */
static uint64_t work_slot(uint32_t worker, uint64_t key)
{
    return km_u64map_key(key ^ ((uint64_t)(worker + 1) * UINT64_C(0x9E3779B97F4A7C15)));
}

static void count_add(km_u64map *m, uint64_t slot)
{
    uint64_t *n = km_u64map_find(m, slot);
    if (n)
        (*n)++;
    else
        (void)km_u64map_put(m, slot, 1, 1); /* out of memory: that key is not counted */
}

static void count_drop(km_u64map *m, uint64_t slot)
{
    uint64_t *n = km_u64map_find(m, slot);
    if (n && *n > 1)
        (*n)--;
    else if (n)
        km_u64map_erase(m, slot);
}

/* Add one worker's held work to the remote sums (leave = false) or take it out. */
static void work_sum(km_cluster *c, uint32_t worker, const held_work *w, bool leave)
{
    for (uint32_t i = 0; i < w->n_prefixes; i++)
        (leave ? count_drop : count_add)(&c->remote_prefixes, work_slot(worker, w->prefixes[i]));
    for (uint32_t i = 0; i < w->n_queued; i++)
        (leave ? count_drop : count_add)(&c->remote_queued, work_slot(worker, w->queued[i]));
}

static bool work_empty(const held_work *w)
{
    return w->n_prefixes == 0 && w->n_queued == 0;
}

static void work_free(held_work *w)
{
    free(w->prefixes);
    free(w->queued);
    memset(w, 0, sizeof *w);
}

/* Replace p's work on `worker`, keeping the sums; past KM_CLUSTER_REMOTE_WORK_MAX held, only the
 * leading keys are kept (counted). */
static void contribution_set_work(km_cluster *c, contribution *p, uint32_t worker,
                                  const uint64_t *prefixes, uint32_t n_prefixes,
                                  const uint64_t *queued, uint32_t n_queued)
{
    held_work *w = &p->work[worker];
    bool out = excluded(c, p, worker);
    if (!out)
        work_sum(c, worker, w, true);
    c->remote_work_held -= (uint64_t)w->n_prefixes + w->n_queued;
    work_free(w);
    uint64_t room = KM_CLUSTER_REMOTE_WORK_MAX - c->remote_work_held;
    uint32_t keep_p = n_prefixes < room ? n_prefixes : (uint32_t)room;
    room -= keep_p;
    uint32_t keep_q = n_queued < room ? n_queued : (uint32_t)room;
    c->st.work_truncated += (uint64_t)(n_prefixes - keep_p) + (n_queued - keep_q);
    if (keep_p && (w->prefixes = malloc((size_t)keep_p * sizeof *w->prefixes))) {
        memcpy(w->prefixes, prefixes, (size_t)keep_p * sizeof *w->prefixes);
        w->n_prefixes = keep_p;
    }
    if (keep_q && (w->queued = malloc((size_t)keep_q * sizeof *w->queued))) {
        memcpy(w->queued, queued, (size_t)keep_q * sizeof *w->queued);
        w->n_queued = keep_q;
    }
    c->remote_work_held += (uint64_t)w->n_prefixes + w->n_queued;
    if (!out)
        work_sum(c, worker, w, false);
}

/* Take p's loads out of the sum (leave = true) or put them back, as excluded() says now: a change
 * of p's mismatch or of the workers' pools happens between the two calls. */
static void contribution_sum(km_cluster *c, contribution *p, bool leave)
{
    for (uint32_t w = 0; w < c->cfg.max_workers; w++) {
        if (excluded(c, p, w))
            continue;
        work_sum(c, w, &p->work[w], leave);
        if (load_zero(&p->loads[w]))
            continue;
        if (leave)
            load_sub(&c->remote[w], &p->loads[w]);
        else
            load_add(&c->remote[w], &p->loads[w]);
    }
}

static int local_pool_find(const km_cluster *c, const char *name)
{
    for (uint32_t i = 0; i < c->n_local_pools; i++)
        if (!strcmp(c->local_pools[i].name, name))
            return (int)i;
    return -1;
}

static void refusal_count(km_cluster *c, km_cluster_refusal r, const char *why);

/* Was pool `name` one p disagreed on, by the pool list `before` and p's mask over it? */
static bool disagreed(const cluster_pool_fingerprint *before, uint32_t n_before, uint64_t mask,
                      const char *name)
{
    for (uint32_t i = 0; i < n_before; i++)
        if (!strcmp(before[i].name, name))
            return mask >> i & 1u;
    return false;
}

/* Compare p's pool list with this instance's (a pool p does not list is not compared) and sum its
 * loads as the result says. `before` is the local pool list p->mismatch was computed over: a
 * disagreement is counted and logged when it begins, and logged when it ends (lock held; p's
 * loads are out of the sum while the local pool list changes, see km_cluster_set_pools). */
static void compare_pools(km_cluster *c, contribution *p, const cluster_pool_fingerprint *before,
                          uint32_t n_before, bool summed)
{
    uint64_t mask = 0;
    for (uint32_t i = 0; i < c->n_local_pools; i++)
        for (uint32_t k = 0; k < p->n_pools; k++)
            if (!strcmp(p->pools[k].name, c->local_pools[i].name) &&
                p->pools[k].fingerprint != c->local_pools[i].fingerprint)
                mask |= UINT64_C(1) << i;
    for (uint32_t i = 0; i < c->n_local_pools; i++) {
        bool now = mask >> i & 1u;
        bool was = disagreed(before, n_before, p->mismatch, c->local_pools[i].name);
        if (now && !was) {
            char why[320];
            snprintf(why, sizeof why, "instance %s: pool %s's workers differ (fingerprints): its "
                     "load on them and its predictions for it are left out", p->id,
                     c->local_pools[i].name);
            /* Logged whenever one begins: a disagreement is a state, not a message stream. */
            refusal_count(c, KM_CLUSTER_REFUSED_WORKER_MISMATCH, why);
            cluster_log(c, KM_LOG_WARNING "refused a message (%s)", c->st.last_refusal);
        } else if (!now && was) {
            cluster_log(c, KM_LOG_INFO "instance %s agrees on pool %s's workers again: its load "
                        "on them is applied", p->id, c->local_pools[i].name);
        }
    }
    if (summed)
        contribution_sum(c, p, true);
    p->mismatch = mask;
    contribution_sum(c, p, false);
}

static void contribution_clear(km_cluster *c, contribution *p)
{
    static const km_active_load zero;
    for (uint32_t w = 0; w < c->cfg.max_workers; w++) {
        if (!load_zero(&p->loads[w]))
            contribution_set(c, p, w, &zero);
        if (!work_empty(&p->work[w]))
            contribution_set_work(c, p, w, NULL, 0, NULL, 0);
    }
}

static void contribution_drop(km_cluster *c, contribution *p)
{
    contribution_clear(c, p);
    free(p->loads);
    free(p->work);
    free(p->pools);
    memset(p, 0, sizeof *p);
}

static contribution *contribution_find(km_cluster *c, const char *id)
{
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        if (c->peers[i].used && !strcmp(c->peers[i].id, id))
            return &c->peers[i];
    return NULL;
}

/* Drop the contributions silent for expire_ms (lock held). */
static void expire_silent(km_cluster *c, uint64_t now)
{
    uint64_t limit = (uint64_t)c->cfg.expire_ms * NS_PER_MS;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++) {
        contribution *p = &c->peers[i];
        if (p->used && now > p->last_heard_ns && now - p->last_heard_ns >= limit) {
            cluster_log(c, KM_LOG_WARNING
                        "instance %s silent for %" PRIu64 " ms: its contribution is dropped",
                        p->id, (now - p->last_heard_ns) / NS_PER_MS);
            contribution_drop(c, p);
            c->st.expired_instances++;
        }
    }
}

/* ---- publishing (lock held) ----------------------------------------------------------------- */

/* A message not handed to the NATS client: counted, and logged at most once per interval. */
static void publish_failed(km_cluster *c, const char *what)
{
    c->st.publish_failures++;
    uint64_t more;
    if (!log_limit_take(&c->publish_failure_log, mono_ns(), &more))
        return;
    if (more)
        cluster_log(c, KM_LOG_WARNING "a message was not published (%s); %" PRIu64 " more "
                    "since the last line (counted in publish_failures)", what, more);
    else
        cluster_log(c, KM_LOG_WARNING "a message was not published (%s; counted in "
                    "publish_failures)", what);
}

/* Queue m, encoded in c->subject and c->body, for the publisher thread. A full outbox drops it:
 * a state gives its sequence number back (the lock has been held since it was taken, and the
 * next state replaces it anyway); a change or prediction keeps it spent, so the peers see the
 * gap and mark this instance stale until its next state. */
static void outbox_push(km_cluster *c, const cluster_message *m, bool answers_sync)
{
    size_t subject_size = c->subject.length + 1;
    char *copy = NULL;
    if (c->outbox_count < c->cfg.outbox_max_messages &&
        c->outbox_bytes + c->body.length <= KM_CLUSTER_OUTBOX_MAX_BYTES)
        copy = malloc(subject_size + c->body.length);
    if (!copy) {
        if (m->kind == CLUSTER_STATE && c->seq == m->seq)
            c->seq--;
        c->st.publish_outbox_full += c->outbox_count > 0;
        publish_failed(c, c->outbox_count ? "the outbox is full: NATS takes nothing"
                                          : "out of memory");
        return;
    }
    memcpy(copy, c->subject.data, subject_size);
    memcpy(copy + subject_size, c->body.data, c->body.length);
    uint32_t tail = (c->outbox_head + c->outbox_count) % c->cfg.outbox_max_messages;
    c->outbox[tail] = (outgoing){.subject = copy, .body = copy + subject_size,
                                 .length = c->body.length, .kind = m->kind, .seq = m->seq,
                                 .answers_sync = answers_sync};
    c->outbox_count++;
    c->outbox_bytes += c->body.length;
    c->outbox_queued++;
    if (m->kind != CLUSTER_SYNC)
        c->sent_seq = m->seq;
    pthread_cond_signal(&c->outbox_cond);
}

/* Encode m and queue it for the publisher thread (answers_sync: a state answering the sync
 * requests received before it). */
static void publish(km_cluster *c, const cluster_message *m, bool answers_sync)
{
    int rc = km_cluster_subject(&c->subject, c->prefix, m->kind, c->instance);
    if (rc == KM_OK)
        rc = km_cluster_encode(&c->body, m, c->message_max);
    if (rc == KM_ERR_TOO_LARGE && m->n_work) {
        /* The loads still go out; the receivers hold no work of these workers until a message
         * that fits carries it. */
        cluster_message bare = *m;
        bare.work = NULL;
        bare.n_work = 0;
        c->st.work_omitted++;
        if (!c->work_omitted_logged)
            cluster_log(c, KM_LOG_WARNING
                        "a %s message with its in-flight work is over %u bytes: sent without "
                        "it (the peers see the loads only)",
                        m->kind == CLUSTER_STATE ? "state" : "change", c->message_max);
        c->work_omitted_logged = true;
        rc = km_cluster_encode(&c->body, &bare, c->message_max);
    } else if (rc == KM_ERR_TOO_LARGE && m->kind == CLUSTER_PREDICT && m->n_hashes > 1) {
        /* A server of a lower max_payload: the leading blocks that fit (a prefix match needs no
         * more). Each hash takes 19 bytes ("16 hex digits" and a comma). */
        cluster_message cut = *m;
        uint64_t over = (uint64_t)c->body.length - c->message_max;
        uint64_t drop = (over + 18) / 19;
        if (drop < m->n_hashes) {
            cut.n_hashes = m->n_hashes - (uint32_t)drop;
            rc = km_cluster_encode(&c->body, &cut, c->message_max);
        }
    }
    if (rc != KM_OK) {
        c->st.publish_failures++;
        c->st.publish_too_large += rc == KM_ERR_TOO_LARGE;
        /* A state not sent gives its sequence number back (the lock has been held since it was
         * taken): the peers count no message as lost, and the next state replaces it anyway. A
         * change or prediction keeps it spent, so the peers see the gap and mark this instance
         * stale until its next state. */
        if (m->kind == CLUSTER_STATE && c->seq == m->seq)
            c->seq--;
        if (rc == KM_ERR_TOO_LARGE && !c->too_large_logged)
            cluster_log(c, KM_LOG_WARNING
                        "a %s message of %u workers, %u hashes is over %u bytes without its "
                        "work: not sent (counted in publish_failures and publish_too_large; the "
                        "peers keep what they had)", m->kind == CLUSTER_STATE    ? "state"
                                : m->kind == CLUSTER_PREDICT ? "predict"
                                                             : "change",
                        m->n_workers, m->n_hashes, c->message_max);
        c->too_large_logged |= rc == KM_ERR_TOO_LARGE;
        return;
    }
    outbox_push(c, m, answers_sync);
}

/* The full state: every worker with a non-zero load, and the peers this instance hears. A call
 * made while connected settles the sync requests received before it: a state that goes out
 * answers them, and one that cannot is not retried for them (one over KM_CLUSTER_MESSAGE_MAX would
 * not fit later either); while disconnected they stay due, for the state sent on connecting. */
static void publish_state(km_cluster *c)
{
    c->last_state_ns = mono_ns();
    if (!c->connected)
        return; /* sync requests stay due: the state sent on (re)connecting answers them */
    bool answers = c->sync_answer_due;
    c->sync_answer_due = false;
    cluster_worker_load rows[256];
    cluster_worker_work work_rows[256];
    cluster_worker_load *w = rows;
    cluster_worker_work *work = work_rows;
    uint32_t n = 0, n_work = 0;
    for (uint32_t i = 0; i < c->cfg.max_workers; i++)
        n += !load_zero(&c->local[i]) || !work_empty(&c->local_work[i]);
    if (n > 256 && (!(w = malloc(n * sizeof *w)) || !(work = malloc(n * sizeof *work)))) {
        if (w != rows)
            free(w);
        c->st.publish_failures++;
        return;
    }
    n = 0;
    for (uint32_t i = 0; i < c->cfg.max_workers; i++) {
        const held_work *lw = &c->local_work[i];
        if (!load_zero(&c->local[i]) || !work_empty(lw))
            w[n++] = (cluster_worker_load){i, c->local[i], CLUSTER_NO_WORK_ROW};
        if (!work_empty(lw))
            work[n_work++] = (cluster_worker_work){i, lw->prefixes, lw->n_prefixes, lw->queued,
                                                   lw->n_queued};
    }
    char peers[KM_CLUSTER_MAX_INSTANCES][KM_CLUSTER_INSTANCE_MAX + 1];
    uint32_t np = 0;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        if (c->peers[i].used)
            memcpy(peers[np++], c->peers[i].id, KM_CLUSTER_INSTANCE_MAX + 1);
    cluster_message m = {.kind = CLUSTER_STATE, .incarnation = c->incarnation, .seq = ++c->seq,
                         .workers = w, .n_workers = n, .work = work, .n_work = n_work,
                         .peers = peers, .n_peers = np,
                         .pools = c->local_pools, .n_pools = c->n_local_pools};
    memcpy(m.instance, c->instance, strlen(c->instance) + 1);
    publish(c, &m, answers);
    if (w != rows)
        free(w);
    if (work != work_rows)
        free(work);
}

static void publish_sync_request(km_cluster *c)
{
    cluster_message m = {.kind = CLUSTER_SYNC, .incarnation = c->incarnation};
    memcpy(m.instance, c->instance, strlen(c->instance) + 1);
    publish(c, &m, false);
}

static bool hashes_equal(const uint64_t *a, uint32_t na, const uint64_t *b, uint32_t nb)
{
    return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a));
}

/* Keep a copy of hashes[0..n) in *to (lock held); false when out of memory (*to unchanged). */
static bool hashes_copy(uint64_t **to, uint32_t *n_to, const uint64_t *hashes, uint32_t n)
{
    uint64_t *copy = NULL;
    if (n && !(copy = malloc((size_t)n * sizeof *copy)))
        return false;
    if (n)
        memcpy(copy, hashes, (size_t)n * sizeof *copy);
    free(*to);
    *to = copy;
    *n_to = n;
    return true;
}

/* This instance's `worker` now has *load and (when `work` is not NULL) that in-flight work: a
 * change goes out when either differs from what was last published (lock held). */
/* Publish worker's load and (work non-NULL) in-flight work where either changed; true when the
 * work kept for it changed. */
static bool publish_worker(km_cluster *c, uint32_t worker, const km_active_load *load,
                           const held_work *work)
{
    held_work *lw = &c->local_work[worker];
    bool work_changed = work && (!hashes_equal(lw->prefixes, lw->n_prefixes, work->prefixes,
                                               work->n_prefixes) ||
                                 !hashes_equal(lw->queued, lw->n_queued, work->queued,
                                               work->n_queued));
    if (load_equal(&c->local[worker], load) && !work_changed)
        return false;
    c->local[worker] = *load;
    if (work_changed &&
        (!hashes_copy(&lw->prefixes, &lw->n_prefixes, work->prefixes, work->n_prefixes) ||
         !hashes_copy(&lw->queued, &lw->n_queued, work->queued, work->n_queued)))
        work_free(lw); /* out of memory: the peers hold none of this worker's work */
    if (!c->connected) {
        c->st.skipped_disconnected++; /* the state sent on reconnect carries it */
        return work_changed;
    }
    cluster_worker_load row = {worker, *load, CLUSTER_NO_WORK_ROW};
    cluster_worker_work work_row = {worker, lw->prefixes, lw->n_prefixes, lw->queued,
                                    lw->n_queued};
    cluster_message m = {.kind = CLUSTER_CHANGE, .incarnation = c->incarnation, .seq = ++c->seq,
                         .workers = &row, .n_workers = 1, .work = &work_row,
                         .n_work = work_empty(lw) ? 0 : 1};
    memcpy(m.instance, c->instance, strlen(c->instance) + 1);
    c->changes_made++;
    if (c->cfg.drop_one_in && c->changes_made % c->cfg.drop_one_in == 0)
        c->st.publish_failures++; /* injected loss: the sequence number is spent */
    else
        publish(c, &m, false);
    return work_changed;
}

int km_cluster_publish_load(km_cluster *c, uint32_t worker, const km_active_load *load)
{
    if (!c || !load)
        return KM_ERR_NULL_POINTER;
    if (worker >= c->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    pthread_mutex_lock(&c->lock);
    publish_worker(c, worker, load, NULL);
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_publish_work(km_cluster *c, uint32_t worker, const km_active_load *load,
                            const uint64_t *prefixes, uint32_t n_prefixes, const uint64_t *queued,
                            uint32_t n_queued)
{
    if (!c || !load || (!prefixes && n_prefixes) || (!queued && n_queued))
        return KM_ERR_NULL_POINTER;
    if (worker >= c->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    pthread_mutex_lock(&c->lock);
    held_work w = {(uint64_t *)prefixes, n_prefixes, (uint64_t *)queued, n_queued};
    uint64_t cut = 0;
    if (w.n_prefixes > KM_CLUSTER_WORK_MAX_PREFIXES) {
        cut += w.n_prefixes - KM_CLUSTER_WORK_MAX_PREFIXES;
        w.n_prefixes = KM_CLUSTER_WORK_MAX_PREFIXES;
    }
    if (w.n_queued > KM_CLUSTER_WORK_MAX_QUEUED) {
        cut += w.n_queued - KM_CLUSTER_WORK_MAX_QUEUED;
        w.n_queued = KM_CLUSTER_WORK_MAX_QUEUED;
    }
    /* Counted once per list that replaces the kept one: the same cut list published again (its
     * worker's load changing) sends nothing new. */
    if (publish_worker(c, worker, load, &w))
        c->st.work_truncated += cut;
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_publish_prediction(km_cluster *c, const char *pool, uint32_t worker, bool lesson,
                                  const uint64_t *hashes, uint32_t n_hashes)
{
    if (!c || !pool || (!hashes && n_hashes))
        return KM_ERR_NULL_POINTER;
    if (worker >= c->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    if (!km_cluster_pool_name_valid(pool, strlen(pool)))
        return KM_ERR_INVALID_ARGUMENT;
    if (n_hashes == 0)
        return KM_OK;
    pthread_mutex_lock(&c->lock);
    if (!c->connected) {
        c->st.skipped_disconnected++;
    } else {
        cluster_message m = {.kind = CLUSTER_PREDICT, .incarnation = c->incarnation,
                             .seq = ++c->seq, .worker = worker, .lesson = lesson,
                             .hashes = (uint64_t *)hashes};
        m.n_hashes = n_hashes < KM_CLUSTER_PREDICTION_MAX_HASHES ? n_hashes
                                                                 : KM_CLUSTER_PREDICTION_MAX_HASHES;
        memcpy(m.instance, c->instance, strlen(c->instance) + 1);
        memcpy(m.pool, pool, strlen(pool) + 1);
        publish(c, &m, false);
    }
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_set_pools(km_cluster *c, const km_cluster_pool *pools, uint32_t n_pools)
{
    if (!c || (!pools && n_pools))
        return KM_ERR_NULL_POINTER;
    if (n_pools > KM_CLUSTER_MAX_POOLS)
        return KM_ERR_INVALID_ARGUMENT;
    int8_t *map = malloc(c->cfg.max_workers);
    if (!map)
        return KM_ERR_OUT_OF_MEMORY;
    memset(map, -1, c->cfg.max_workers);
    for (uint32_t i = 0; i < n_pools; i++) {
        if (!pools[i].name || !km_cluster_pool_name_valid(pools[i].name, strlen(pools[i].name)) ||
            (!pools[i].workers && pools[i].n_workers)) {
            free(map);
            return KM_ERR_INVALID_ARGUMENT;
        }
        for (uint32_t k = 0; k < pools[i].n_workers; k++) {
            uint32_t w = pools[i].workers[k];
            if (w >= c->cfg.max_workers || map[w] >= 0) {
                free(map);
                return KM_ERR_INVALID_ARGUMENT;
            }
            map[w] = (int8_t)i;
        }
    }
    cluster_pool_fingerprint before[KM_CLUSTER_MAX_POOLS]; /* about 5 KiB */
    pthread_mutex_lock(&c->lock);
    /* Every contribution leaves the sum, the workers' pools change, each is compared again
     * (a disagreement that goes on is not counted or logged again) and summed as it says. */
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        if (c->peers[i].used)
            contribution_sum(c, &c->peers[i], true);
    uint32_t n_before = c->n_local_pools;
    memcpy(before, c->local_pools, sizeof before);
    memcpy(c->worker_pool, map, c->cfg.max_workers);
    c->n_local_pools = n_pools;
    for (uint32_t i = 0; i < n_pools; i++) {
        snprintf(c->local_pools[i].name, sizeof c->local_pools[i].name, "%s", pools[i].name);
        c->local_pools[i].fingerprint = pools[i].fingerprint;
    }
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        if (c->peers[i].used)
            compare_pools(c, &c->peers[i], before, n_before, false);
    publish_state(c); /* the peers compare at once */
    pthread_mutex_unlock(&c->lock);
    free(map);
    return KM_OK;
}

/* ---- applying (NATS delivery thread) -------------------------------------------------------- */

/* s into out[0..size) as printable UTF-8: a control character or a byte that does not begin a
 * well-formed sequence becomes '?', and the copy ends before a character that would not fit
 * whole. A refusal's reason quotes what the message carried (its kind, its subject, the JSON
 * parser's view of it): it goes to a log line, where a newline would forge another line, and to
 * /status, whose JSON strings must be UTF-8. */
static void printable_copy(char *out, size_t size, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t left = strlen(s), n = 0;
    while (left) {
        size_t k = *p < 0x80 ? 1 : km_utf8_sequence(p, left);
        bool plain = k > 0 && *p >= 0x20 && *p != 0x7f;
        size_t take = plain ? k : 1;
        if (n + take >= size)
            break;
        if (plain)
            memcpy(out + n, p, k);
        else
            out[n] = '?';
        n += take;
        p += take;
        left -= take;
    }
    out[n] = '\0';
}

/* Count a refused message and keep why; log it unless its reason was logged in the last
 * KM_CLUSTER_REFUSAL_LOG_NS (a peer that keeps sending what is refused costs one line per
 * interval, not one per message, while the lock is held). */
static void refusal_count(km_cluster *c, km_cluster_refusal r, const char *why)
{
    c->st.refused[r]++;
    int at = snprintf(c->st.last_refusal, sizeof c->st.last_refusal, "%s: ",
                      km_cluster_refusal_name(r));
    printable_copy(c->st.last_refusal + at, sizeof c->st.last_refusal - (size_t)at, why);
}

static void refused(km_cluster *c, km_cluster_refusal r, const char *why)
{
    refusal_count(c, r, why);
    uint64_t more;
    if (!log_limit_take(&c->refusal_log[r], mono_ns(), &more))
        return;
    if (more)
        cluster_log(c, KM_LOG_WARNING "refused a message (%s); %" PRIu64 " more %s refusals "
                    "since the last line", c->st.last_refusal, more, km_cluster_refusal_name(r));
    else
        cluster_log(c, KM_LOG_WARNING "refused a message (%s)", c->st.last_refusal);
}

static bool expected_has(const km_cluster *c, const char *id)
{
    for (uint32_t i = 0; i < c->n_expected; i++)
        if (!strcmp(c->expected[i], id))
            return true;
    return false;
}

static void expect_peer(km_cluster *c, const char *id)
{
    if (strcmp(id, c->instance) && !expected_has(c, id) && c->n_expected < KM_CLUSTER_MAX_INSTANCES)
        memcpy(c->expected[c->n_expected++], id, KM_CLUSTER_INSTANCE_MAX + 1);
}

/* A change's or state's worker rows: each listed worker's load and in-flight work (none when the
 * message has no work row for it; the decoder found each row) replace what p said before. */
static void apply_workers(km_cluster *c, contribution *p, const cluster_message *m)
{
    for (uint32_t i = 0; i < m->n_workers; i++) {
        uint32_t worker = m->workers[i].worker;
        contribution_set(c, p, worker, &m->workers[i].load);
        uint32_t row = m->workers[i].work_row;
        const cluster_worker_work *w = row < m->n_work ? &m->work[row] : NULL;
        if (w)
            contribution_set_work(c, p, worker, w->prefixes, w->n_prefixes, w->queued,
                                  w->n_queued);
        else if (!work_empty(&p->work[worker]))
            contribution_set_work(c, p, worker, NULL, 0, NULL, 0);
    }
}

/* One decoded message (lock held). */
static void apply(km_cluster *c, const cluster_message *m, uint64_t now)
{
    char why[160];
    if (!strcmp(m->instance, c->instance)) {
        const char *what = m->kind == CLUSTER_SYNC      ? "sync"
                           : m->kind == CLUSTER_PREDICT ? "prediction"
                                                        : "load";
        snprintf(why, sizeof why, "a %s message under this instance's own id (incarnation %" PRIu64
                 ", this one %" PRIu64 ")", what, m->incarnation, c->incarnation);
        refused(c, KM_CLUSTER_REFUSED_OWN_ID, why);
        return;
    }
    if (m->kind == CLUSTER_SYNC) {
        /* The heartbeat thread (woken by on_message) publishes the answer: one state for every
         * request that arrives until it goes out; every peer applies it like a heartbeat. */
        c->st.sync_requests++;
        c->sync_answer_due = true;
        return;
    }
    contribution *p = contribution_find(c, m->instance);
    if (p && m->incarnation < p->incarnation) {
        snprintf(why, sizeof why, "instance %s incarnation %" PRIu64 " after %" PRIu64,
                 m->instance, m->incarnation, p->incarnation);
        refused(c, KM_CLUSTER_REFUSED_OLD_INCARNATION, why);
        return;
    }
    if (p && m->incarnation > p->incarnation) {
        cluster_log(c, KM_LOG_INFO
                    "instance %s restarted (incarnation %" PRIu64 "): its old contribution "
                    "is replaced", m->instance, m->incarnation);
        contribution_clear(c, p);
        p->incarnation = m->incarnation;
        p->last_seq = 0;
        p->has_baseline = false;
        /* The new process's pools are unknown until its full state, as a new instance's: the
         * old process's disagreement (its configuration) goes with its contribution. */
        p->n_pools = 0;
        p->mismatch = 0;
        c->st.restarted_instances++;
    }
    if (!p) {
        for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES && !p; i++)
            if (!c->peers[i].used)
                p = &c->peers[i];
        km_active_load *loads = p ? calloc(c->cfg.max_workers, sizeof *loads) : NULL;
        held_work *work = loads ? calloc(c->cfg.max_workers, sizeof *work) : NULL;
        cluster_pool_fingerprint *pools = work ? calloc(KM_CLUSTER_MAX_POOLS, sizeof *pools)
                                               : NULL;
        if (!pools) {
            free(loads);
            free(work);
            snprintf(why, sizeof why, "instance %s: %s", m->instance,
                     p ? "out of memory" : "already applying the most instances");
            refused(c, KM_CLUSTER_REFUSED_TOO_MANY, why);
            return;
        }
        memset(p, 0, sizeof *p);
        p->used = true;
        p->loads = loads;
        p->work = work;
        p->pools = pools;
        p->incarnation = m->incarnation;
        memcpy(p->id, m->instance, sizeof p->id);
    }
    if (p->last_seq && m->seq <= p->last_seq) {
        snprintf(why, sizeof why, "instance %s seq %" PRIu64 " after %" PRIu64, m->instance,
                 m->seq, p->last_seq);
        refused(c, KM_CLUSTER_REFUSED_DUPLICATE, why);
        return;
    }
    if (p->last_seq && m->seq - p->last_seq > KM_CLUSTER_SEQ_JUMP_MAX) {
        /* Not that many lost: taken, it would count them and refuse the sender's real next
         * messages as duplicates until its contribution expired. */
        snprintf(why, sizeof why, "instance %s seq %" PRIu64 " after %" PRIu64 ": a jump past "
                 "2^32", m->instance, m->seq, p->last_seq);
        refused(c, KM_CLUSTER_REFUSED_MALFORMED, why);
        return;
    }
    if (p->last_seq && m->seq > p->last_seq + 1) {
        uint64_t lost = m->seq - p->last_seq - 1, more;
        c->st.lost_messages += lost;
        if (log_limit_take(&c->gap_log, now, &more)) { /* a lossy link: one line per interval */
            char since[96] = "";
            if (more)
                snprintf(since, sizeof since, "; %" PRIu64 " more gaps since the last line (all "
                         "counted in lost_messages)", more);
            cluster_log(c, KM_LOG_WARNING
                        "instance %s: %" PRIu64 " message%s lost (seq %" PRIu64 " after %" PRIu64
                        ")%s%s", m->instance, lost, lost == 1 ? "" : "s", m->seq, p->last_seq,
                        m->kind == CLUSTER_STATE ? "; this full state replaces its contribution"
                                                 : "; stale until its next full state",
                        since);
        }
        if (m->kind != CLUSTER_STATE) /* whatever was lost, the contribution may lack it */
            p->stale = true;
    }
    p->last_seq = m->seq;
    p->last_heard_ns = now;
    if (m->kind == CLUSTER_STATE) {
        contribution_clear(c, p);
        /* The pool list first: the loads below are summed as it says. */
        if (m->n_pools)
            memcpy(p->pools, m->pools, (size_t)m->n_pools * sizeof *p->pools);
        p->n_pools = m->n_pools;
        compare_pools(c, p, c->local_pools, c->n_local_pools, true);
        apply_workers(c, p, m);
        p->has_baseline = true;
        p->stale = false;
        p->answered_sync = true;
        if (c->sync_running) {
            expect_peer(c, m->instance);
            for (uint32_t i = 0; i < m->n_peers; i++)
                expect_peer(c, m->peers[i]);
            pthread_cond_broadcast(&c->cond);
        }
    } else {
        if (m->kind == CLUSTER_CHANGE)
            apply_workers(c, p, m);
        if (!p->has_baseline)
            p->stale = true;
    }
    int slot = m->kind == CLUSTER_PREDICT ? local_pool_find(c, m->pool) : -1;
    if (m->kind == CLUSTER_PREDICT && !p->has_baseline) {
        /* Its pools are not known yet, so whether its worker ids mean ours cannot be told.
         * Counted, not logged: a peer's first messages may all be predictions. */
        c->st.refused[KM_CLUSTER_REFUSED_NO_STATE]++;
        snprintf(c->st.last_refusal, sizeof c->st.last_refusal,
                 "no_state: instance %.40s: a prediction for pool %.40s before its full state",
                 m->instance, m->pool);
    } else if (slot >= 0 && (p->mismatch >> slot & 1u)) {
        /* Counted, not logged: the disagreement was logged when it began. */
        c->st.refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH]++;
        snprintf(c->st.last_refusal, sizeof c->st.last_refusal,
                 "worker_mismatch: instance %.40s: a prediction for pool %.40s, whose workers "
                 "differ",
                 m->instance, m->pool);
    } else if (m->kind != CLUSTER_PREDICT) {
        c->st.applied++;
    } else {
        c->st.applied++;
        c->st.predictions_received++;
        km_cluster_prediction pr = {m->instance, m->pool, m->worker, m->lesson, m->hashes,
                                    m->n_hashes};
        if (c->cfg.on_prediction)
            c->cfg.on_prediction(c->cfg.on_prediction_user, &pr);
    }
    for (uint32_t i = 0; c->cfg.on_applied && i < m->n_workers; i++)
        c->cfg.on_applied(c->cfg.on_applied_user, m->instance, m->workers[i].worker,
                          &m->workers[i].load);
}

static void on_message(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
    (void)nc;
    (void)sub;
    km_cluster *c = closure;
    uint64_t now = mono_ns();
    const char *subject = natsMsg_GetSubject(msg);
    pthread_mutex_lock(&c->lock);
    if (c->closing) {
        pthread_mutex_unlock(&c->lock);
        natsMsg_Destroy(msg);
        return;
    }
    c->callbacks_running++;
    pthread_mutex_unlock(&c->lock);

    cluster_message m;
    km_cluster_refusal r;
    char why[160];
    bool ok = false;
    /* Decoding runs outside the lock: it touches only the message. */
    if (strncmp(subject, c->prefix, c->prefix_len) || subject[c->prefix_len] != '.') {
        r = KM_CLUSTER_REFUSED_SUBJECT;
        snprintf(why, sizeof why, "subject \"%.80s\" outside the prefix", subject);
    } else {
        ok = km_cluster_decode(subject + c->prefix_len + 1, natsMsg_GetData(msg),
                               (size_t)natsMsg_GetDataLength(msg), c->cfg.max_workers, &m, &r, why,
                               sizeof why);
    }
    pthread_mutex_lock(&c->lock);
    if (ok)
        apply(c, &m, now);
    else
        refused(c, r, why);
    c->callbacks_running--;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    if (ok)
        km_cluster_message_free(&m);
    natsMsg_Destroy(msg);
}

/* ---- connection events ---------------------------------------------------------------------- */

/* The largest body a server of that max_payload takes (0 = unknown: KM_CLUSTER_MESSAGE_MAX). */
static uint32_t message_max_for(int64_t max_payload)
{
    return max_payload > 0 && max_payload < KM_CLUSTER_MESSAGE_MAX ? (uint32_t)max_payload
                                                                   : KM_CLUSTER_MESSAGE_MAX;
}

/* Connected (first time late, or again): the state goes out, then the peers are asked for theirs. */
static void on_connected(natsConnection *nc, void *closure)
{
    km_cluster *c = closure;
    uint32_t message_max = message_max_for(natsConnection_GetMaxPayload(nc));
    pthread_mutex_lock(&c->lock);
    if (!c->closing) {
        c->message_max = message_max;
        bool again = c->synced || c->st.sync_peers || !isnan(c->st.sync_seconds);
        c->connected = true;
        c->st.reconnects += again;
        cluster_log(c, KM_LOG_INFO
                    "connected to %s: sending state, asking peers for theirs", c->url_shown);
        publish_state(c);
        publish_sync_request(c);
        c->synced = true;
    }
    pthread_mutex_unlock(&c->lock);
}

static void on_disconnected(natsConnection *nc, void *closure)
{
    (void)nc;
    km_cluster *c = closure;
    pthread_mutex_lock(&c->lock);
    if (!c->closing) {
        c->connected = false;
        for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
            if (c->peers[i].used)
                c->peers[i].stale = true;
        cluster_log(c, KM_LOG_WARNING
                    "disconnected from %s: routing on this instance's view; remote "
                    "contributions are stale and expire in %u ms", c->url_shown, c->cfg.expire_ms);
    }
    pthread_mutex_unlock(&c->lock);
}

/* An error the NATS client reports outside any call, from its own thread: the server refusing
 * this instance a publish or its subscription (a permissions violation: the peers then miss its
 * load, or it theirs), or the subscription falling behind (a slow consumer: the client dropped
 * messages, which also arrive as sequence gaps). Counted, kept as the last, and logged as a
 * warning at most once per interval. */
static void on_nats_error(natsConnection *nc, natsSubscription *sub, natsStatus err, void *closure)
{
    km_cluster *c = closure;
    char why[sizeof c->st.last_nats_error];
    if (err == NATS_SLOW_CONSUMER) {
        int64_t dropped = 0;
        if (sub)
            natsSubscription_GetDropped(sub, &dropped);
        snprintf(why, sizeof why, "slow consumer: the NATS client has dropped %" PRId64
                 " messages of this instance's subscription", dropped);
    } else {
        const char *text = NULL;
        natsConnection_GetLastError(nc, &text); /* the server's words, where it gave any */
        snprintf(why, sizeof why, "%s%s%s", natsStatus_GetText(err), text && *text ? ": " : "",
                 text ? text : "");
    }
    pthread_mutex_lock(&c->lock);
    c->st.nats_errors++;
    c->st.nats_slow_consumer += err == NATS_SLOW_CONSUMER;
    printable_copy(c->st.last_nats_error, sizeof c->st.last_nats_error, why);
    uint64_t more;
    if (!c->closing && log_limit_take(&c->nats_error_log, mono_ns(), &more)) {
        char since[96] = "";
        if (more)
            snprintf(since, sizeof since, "; %" PRIu64 " more since the last line", more);
        cluster_log(c, KM_LOG_WARNING "NATS reported an error: %s%s", c->st.last_nats_error,
                    since);
    }
    pthread_mutex_unlock(&c->lock);
}

/* The subscription's last delivery has returned: from here on_message never runs again, not even
 * one that libnats had begun before `closing` was set. */
static void on_subscription_complete(void *closure)
{
    km_cluster *c = closure;
    pthread_mutex_lock(&c->lock);
    c->sub_complete = true;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

static void on_closed(natsConnection *nc, void *closure)
{
    (void)nc;
    km_cluster *c = closure;
    pthread_mutex_lock(&c->lock);
    c->nats_closed = true;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

/* ---- heartbeat ------------------------------------------------------------------------------ */

/* The heartbeat, and the answers to the peers' sync requests. A state answers every request
 * received before it, and a request makes one go out no sooner than sync_answer_ms after the
 * previous state (at once when that has passed): a burst of requests, such as every instance
 * reconnecting after a NATS restart, costs each peer one state per sync_answer_ms, not one per
 * request, and no request waits longer than sync_answer_ms. */
static void *heartbeat_main(void *arg)
{
    km_cluster *c = arg;
    const uint64_t spacing = (uint64_t)c->cfg.sync_answer_ms * NS_PER_MS;
    pthread_mutex_lock(&c->lock);
    uint64_t due = mono_ns() + (uint64_t)c->cfg.heartbeat_ms * NS_PER_MS;
    while (!c->closing) {
        /* c->cond is also broadcast by every delivery (a sync request among them): only the
         * deadlines make a state. */
        uint64_t wake = due;
        if (c->sync_answer_due && c->connected && c->last_state_ns + spacing < wake)
            wake = c->last_state_ns + spacing;
        struct timespec ts;
        deadline_in(&ts, wake, 0);
        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
        if (c->closing)
            break;
        uint64_t now = mono_ns();
        if (now >= due) {
            due = now + (uint64_t)c->cfg.heartbeat_ms * NS_PER_MS;
            expire_silent(c, now);
            /* During the start's sync too: the peers hold a starting instance only while it
             * speaks, and its sync may wait sync_timeout_ms (longer than expire_ms) for a peer
             * that is gone. */
            publish_state(c);
        }
        if (c->sync_answer_due && c->connected && now >= c->last_state_ns + spacing)
            publish_state(c);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* ---- the publisher thread ------------------------------------------------------------------ */

/* Hands the outbox's messages to the NATS client in order, each outside the lock (a publish to a
 * server that stops reading waits up to KM_CLUSTER_WRITE_DEADLINE_MS; meanwhile the decisions go
 * on and the outbox fills). A message taken while disconnected is not published (counted in
 * skipped_disconnected; its sequence number is a gap to the peers, whom the state sent on
 * reconnecting repairs): nothing is replayed late. On closing it drains the outbox while
 * connected and until a publish fails. */
static void *publisher_main(void *arg)
{
    km_cluster *c = arg;
    enum { BATCH = 64 }; /* taken per lock: a burst costs the decisions' lock little */
    outgoing batch[BATCH];
    bool send[BATCH];
    bool failed_closing = false;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->outbox_count && !c->closing)
            pthread_cond_wait(&c->outbox_cond, &c->lock);
        if (!c->outbox_count)
            break;
        uint32_t n = 0;
        for (; n < BATCH && c->outbox_count; n++) {
            batch[n] = c->outbox[c->outbox_head];
            c->outbox_head = (c->outbox_head + 1) % c->cfg.outbox_max_messages;
            c->outbox_count--;
            c->outbox_bytes -= batch[n].length;
            send[n] = c->connected && !(c->closing && failed_closing);
            if (send[n]) {
                /* Counted before the publish, so a peer that applies it sees it counted here. */
                c->st.sent++;
                c->st.predictions_sent += batch[n].kind == CLUSTER_PREDICT;
                c->st.sync_answers += batch[n].answers_sync;
            } else {
                c->st.skipped_disconnected++;
            }
        }
        pthread_mutex_unlock(&c->lock);
        natsStatus status[BATCH];
        for (uint32_t i = 0; i < n; i++) {
            status[i] = send[i] ? natsConnection_Publish(c->conn, batch[i].subject, batch[i].body,
                                                         (int)batch[i].length)
                                : NATS_OK;
            free(batch[i].subject);
        }
        pthread_mutex_lock(&c->lock);
        c->outbox_done += n;
        for (uint32_t i = 0; i < n; i++) {
            if (status[i] == NATS_OK)
                continue;
            c->st.sent--;
            c->st.predictions_sent -= batch[i].kind == CLUSTER_PREDICT;
            c->st.sync_answers -= batch[i].answers_sync;
            failed_closing = c->closing;
            char what[96];
            snprintf(what, sizeof what, "NATS: %s", natsStatus_GetText(status[i]));
            publish_failed(c, what);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* ---- create / destroy ----------------------------------------------------------------------- */

static bool prefix_valid(const char *p)
{
    size_t n = strlen(p);
    if (n == 0 || n > 128 || p[0] == '.' || p[n - 1] == '.')
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '.' && p[i + 1] == '.')
            return false;
        if (!(ch == '.' || ch == '_' || ch == '-' || (ch >= 'a' && ch <= 'z') ||
              (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')))
            return false;
    }
    return true;
}

static bool sync_complete(const km_cluster *c)
{
    if (c->n_expected == 0)
        return false;
    for (uint32_t i = 0; i < c->n_expected; i++) {
        const contribution *p = contribution_find((km_cluster *)c, c->expected[i]);
        if (!p || !p->answered_sync)
            return false;
    }
    return true;
}

static void deadline_in(struct timespec *ts, uint64_t from_ns, uint64_t after_ns)
{
    uint64_t t = from_ns + after_ns;
    ts->tv_sec = (time_t)(t / UINT64_C(1000000000));
    ts->tv_nsec = (long)(t % UINT64_C(1000000000));
}

/* Ask the peers for their state and wait until every peer learnt of has answered, or no peer
 * answered within sync_quiet_ms, or sync_timeout_ms passed (lock held, connected). */
static void sync_with_peers(km_cluster *c)
{
    uint64_t t0 = mono_ns();
    c->sync_running = true;
    c->n_expected = 0;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        c->peers[i].answered_sync = false;
    publish_state(c);
    publish_sync_request(c);
    /* The request on its way before the quiet wait counts, within the sync's own time limit (the
     * loop below counts this time too): a server that stalls after the connect does not hold the
     * create past sync_timeout_ms. */
    const uint64_t limit = (uint64_t)c->cfg.sync_timeout_ms * NS_PER_MS;
    uint64_t queued = c->outbox_queued;
    while (c->outbox_done < queued && mono_ns() - t0 < limit) {
        struct timespec ts;
        deadline_in(&ts, mono_ns(), NS_PER_MS);
        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
    }
    uint64_t spent = mono_ns() - t0;
    if (spent < limit) {
        pthread_mutex_unlock(&c->lock);
        natsConnection_FlushTimeout(c->conn, (int64_t)((limit - spent) / NS_PER_MS) + 1);
        pthread_mutex_lock(&c->lock);
    }
    for (;;) {
        uint64_t now = mono_ns();
        uint64_t waited = now - t0;
        if (sync_complete(c))
            break;
        if (c->n_expected == 0 && waited >= (uint64_t)c->cfg.sync_quiet_ms * NS_PER_MS)
            break;
        if (waited >= limit) {
            uint32_t silent = 0;
            for (uint32_t i = 0; i < c->n_expected; i++) {
                const contribution *p = contribution_find(c, c->expected[i]);
                silent += !p || !p->answered_sync;
            }
            cluster_log(c, KM_LOG_WARNING
                        "sync: %u of the %u peers learnt of did not answer within %u ms",
                        silent, c->n_expected, c->cfg.sync_timeout_ms);
            break;
        }
        struct timespec ts;
        deadline_in(&ts, now, 5 * NS_PER_MS); /* the cond runs on CLOCK_MONOTONIC */
        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
    }
    c->sync_running = false;
    c->synced = true;
    c->st.sync_seconds = (double)(mono_ns() - t0) / 1e9;
    uint32_t answered = 0;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++)
        answered += c->peers[i].used && c->peers[i].answered_sync;
    c->st.sync_peers = answered;
    cluster_log(c, KM_LOG_INFO "took the cluster's view from %u peer%s in %.3f s", answered,
                answered == 1 ? "" : "s", c->st.sync_seconds);
}

int km_cluster_create(const km_cluster_config *cfg, km_cluster **out, char *why, size_t why_size)
{
    if (!out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "out is NULL");
    *out = NULL;
    if (!cfg || !cfg->url || !cfg->instance)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "cluster url and instance are required");
    const char *prefix = cfg->subject_prefix ? cfg->subject_prefix : "kvmatch.cluster";
    if (!km_cluster_id_valid(cfg->instance, strlen(cfg->instance)))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "instance id \"%.80s\": 1 to %u characters of A-Z a-z 0-9 _ -", cfg->instance,
                      KM_CLUSTER_INSTANCE_MAX);
    if (!prefix_valid(prefix))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "subject prefix \"%.80s\": dot-separated tokens of A-Z a-z 0-9 _ -", prefix);
    if (strncmp(cfg->url, "nats://", 7) || !cfg->url[7]) {
        char shown[96];
        km_cluster_url_shown(cfg->url, shown, sizeof shown);
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "cluster url \"%s\" is not nats://HOST:PORT", shown);
    }
    if (cfg->max_workers < 1 || cfg->max_workers > 65534 || cfg->heartbeat_ms < 10 ||
        cfg->expire_ms <= cfg->heartbeat_ms || cfg->sync_timeout_ms > 600000 ||
        cfg->sync_answer_ms > cfg->sync_quiet_ms / 2 || cfg->reconnect_wait_ms < 1 ||
        cfg->outbox_max_messages < 1 || cfg->outbox_max_messages > KM_CLUSTER_OUTBOX_MAX_MESSAGES)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "cluster: max_workers 1..65534, heartbeat_ms >= 10, expire_ms > "
                      "heartbeat_ms, sync_timeout_ms <= 600000, sync_answer_ms <= "
                      "sync_quiet_ms / 2, reconnect_wait_ms >= 1, outbox_max_messages "
                      "1..65536");
    km_cluster *c = calloc(1, sizeof *c);
    if (!c)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "cluster handle");
    c->cfg = *cfg;
    c->url = strdup(cfg->url);
    km_cluster_url_shown(cfg->url, c->url_shown, sizeof c->url_shown);
    c->instance = strdup(cfg->instance);
    c->prefix = strdup(prefix);
    c->prefix_len = strlen(prefix);
    c->local = calloc(cfg->max_workers, sizeof *c->local);
    c->remote = calloc(cfg->max_workers, sizeof *c->remote);
    c->local_work = calloc(cfg->max_workers, sizeof *c->local_work);
    km_u64map_init(&c->remote_prefixes, &c->work_memory);
    km_u64map_init(&c->remote_queued, &c->work_memory);
    c->worker_pool = malloc(cfg->max_workers);
    if (c->worker_pool)
        memset(c->worker_pool, -1, cfg->max_workers);
    c->st.sync_seconds = NAN;
    c->message_max = KM_CLUSTER_MESSAGE_MAX;
    km_text_init(&c->subject, 256);
    km_text_init(&c->body, KM_CLUSTER_MESSAGE_MAX + 1);
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    /* Ordered across restarts of one id (the clock's ns since the epoch). */
    c->incarnation = (uint64_t)rt.tv_sec * UINT64_C(1000000000) + (uint64_t)rt.tv_nsec;
    pthread_mutex_init(&c->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cond, &ca);
    pthread_cond_init(&c->outbox_cond, &ca);
    pthread_condattr_destroy(&ca);
    c->outbox = calloc(c->cfg.outbox_max_messages, sizeof *c->outbox);
    if (!c->url || !c->instance || !c->prefix || !c->local || !c->remote || !c->local_work ||
        !c->worker_pool || !c->outbox) {
        km_cluster_destroy(c);
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "cluster handle");
    }
    c->cfg.pools = NULL; /* the caller's array is read here only */
    c->cfg.n_pools = 0;
    if (cfg->n_pools) { /* before the first message: every peer's is compared against them */
        int rc = km_cluster_set_pools(c, cfg->pools, cfg->n_pools);
        if (rc != KM_OK) {
            km_cluster_destroy(c);
            return km_why(why, why_size, rc, "cluster: the pools given at create: %s",
                          km_strerror(rc));
        }
    }
    natsStatus s = natsOptions_Create(&c->opts);
    if (s == NATS_OK)
        s = natsOptions_SetURL(c->opts, c->url);
    if (s == NATS_OK)
        s = natsOptions_SetNoEcho(c->opts, true);
    if (s == NATS_OK)
        s = natsOptions_SetAllowReconnect(c->opts, true);
    if (s == NATS_OK)
        s = natsOptions_SetMaxReconnect(c->opts, -1);
    if (s == NATS_OK)
        s = natsOptions_SetReconnectWait(c->opts, c->cfg.reconnect_wait_ms);
    if (s == NATS_OK)
        s = natsOptions_SetTimeout(c->opts, 1000);
    if (s == NATS_OK)
        s = natsOptions_SetWriteDeadline(c->opts, KM_CLUSTER_WRITE_DEADLINE_MS);
    if (s == NATS_OK)
        s = natsOptions_SetPingInterval(c->opts, KM_CLUSTER_PING_INTERVAL_MS);
    if (s == NATS_OK)
        s = natsOptions_SetMaxPingsOut(c->opts, KM_CLUSTER_MAX_PINGS_OUT);
    if (s == NATS_OK)
        s = natsOptions_SetRetryOnFailedConnect(c->opts, true, on_connected, c);
    if (s == NATS_OK)
        s = natsOptions_SetDisconnectedCB(c->opts, on_disconnected, c);
    if (s == NATS_OK)
        s = natsOptions_SetReconnectedCB(c->opts, on_connected, c);
    if (s == NATS_OK)
        s = natsOptions_SetClosedCB(c->opts, on_closed, c);
    if (s == NATS_OK)
        s = natsOptions_SetErrorHandler(c->opts, on_nats_error, c);
    if (s != NATS_OK) {
        km_why(why, why_size, KM_ERR_IO, "NATS options: %s", natsStatus_GetText(s));
        km_cluster_destroy(c);
        return KM_ERR_IO;
    }
    s = natsConnection_Connect(&c->conn, c->opts);
    if (s != NATS_OK && s != NATS_NOT_YET_CONNECTED) {
        km_why(why, why_size, KM_ERR_IO, "NATS connect to %s: %s", c->url_shown,
               natsStatus_GetText(s));
        km_cluster_destroy(c);
        return KM_ERR_IO;
    }
    char wildcard[160];
    snprintf(wildcard, sizeof wildcard, "%s.>", c->prefix);
    s = natsConnection_Subscribe(&c->sub, c->conn, wildcard, on_message, c);
    if (s == NATS_OK)
        s = natsSubscription_SetOnCompleteCB(c->sub, on_subscription_complete, c);
    if (s == NATS_OK)
        c->sub_watched = true; /* before any close: destroy reads it after its own close */
    if (s == NATS_OK)
        s = natsSubscription_SetPendingLimits(c->sub, 1 << 20, 256 << 20);
    if (s != NATS_OK) {
        km_why(why, why_size, KM_ERR_IO, "NATS subscribe to %s: %s", wildcard,
               natsStatus_GetText(s));
        km_cluster_destroy(c);
        return KM_ERR_IO;
    }
    /* Before the sync: instances starting together answer each other's sync requests. */
    int thread_rc = pthread_create(&c->heartbeat, NULL, heartbeat_main, c);
    if (thread_rc != 0) {
        km_cluster_destroy(c);
        return km_why(why, why_size, KM_ERR_IO, "cluster heartbeat thread: %s",
                      strerror(thread_rc));
    }
    c->heartbeat_started = true;
    thread_rc = pthread_create(&c->publisher, NULL, publisher_main, c);
    if (thread_rc != 0) {
        km_cluster_destroy(c);
        return km_why(why, why_size, KM_ERR_IO, "cluster publisher thread: %s",
                      strerror(thread_rc));
    }
    c->publisher_started = true;
    bool up = natsConnection_Status(c->conn) == NATS_CONN_STATUS_CONNECTED;
    uint32_t message_max = message_max_for(up ? natsConnection_GetMaxPayload(c->conn) : 0);
    pthread_mutex_lock(&c->lock);
    if (up) {
        c->message_max = message_max;
        c->connected = true;
        sync_with_peers(c);
    } else {
        cluster_log(c, KM_LOG_WARNING
                    "NATS at %s unreachable: routing on this instance's view, retrying every "
                    "%u ms", c->url_shown, c->cfg.reconnect_wait_ms);
    }
    pthread_mutex_unlock(&c->lock);
    *out = c;
    return KM_OK;
}

void km_cluster_destroy(km_cluster *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->closing = true;
    pthread_cond_broadcast(&c->cond);
    pthread_cond_broadcast(&c->outbox_cond);
    pthread_mutex_unlock(&c->lock);
    if (c->heartbeat_started)
        pthread_join(c->heartbeat, NULL);
    if (c->publisher_started)
        pthread_join(c->publisher, NULL); /* the outbox drained */
    if (c->sub)
        natsSubscription_Unsubscribe(c->sub);
    if (c->conn)
        natsConnection_Close(c->conn);
    /* Nothing is freed while a callback may still run: a delivery libnats began before `closing`
     * was set (it may not have reached on_message's lock yet) ends before the subscription's
     * completion, and the closed callback is the client's last. A client that never reports
     * them within KM_CLUSTER_CLOSE_WAIT_MS leaves the handle's memory behind rather than freed
     * under a callback. */
    pthread_mutex_lock(&c->lock);
    uint64_t deadline = mono_ns() + KM_CLUSTER_CLOSE_WAIT_MS * NS_PER_MS;
    bool done;
    while (!(done = c->callbacks_running == 0 && (!c->sub_watched || c->sub_complete) &&
                    (!c->conn || c->nats_closed))) {
        uint64_t now = mono_ns();
        if (now >= deadline)
            break;
        struct timespec ts;
        deadline_in(&ts, now, 5 * NS_PER_MS);
        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
    }
    pthread_mutex_unlock(&c->lock);
    if (!done) {
        cluster_log(c, KM_LOG_ERROR "the NATS client did not report its subscription and "
                    "connection closed within %d ms: the handle's memory is left allocated",
                    (int)KM_CLUSTER_CLOSE_WAIT_MS);
        return;
    }
    natsSubscription_Destroy(c->sub);
    natsConnection_Destroy(c->conn);
    natsOptions_Destroy(c->opts);
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++) {
        for (uint32_t w = 0; c->peers[i].work && w < c->cfg.max_workers; w++)
            work_free(&c->peers[i].work[w]);
        free(c->peers[i].loads);
        free(c->peers[i].work);
        free(c->peers[i].pools);
    }
    for (uint32_t w = 0; c->local_work && w < c->cfg.max_workers; w++)
        work_free(&c->local_work[w]);
    free(c->local_work);
    km_u64map_free(&c->remote_prefixes);
    km_u64map_free(&c->remote_queued);
    free(c->worker_pool);
    km_text_free(&c->subject);
    km_text_free(&c->body);
    for (uint32_t i = 0; c->outbox && i < c->outbox_count; i++)
        free(c->outbox[(c->outbox_head + i) % c->cfg.outbox_max_messages].subject);
    free(c->outbox);
    pthread_cond_destroy(&c->outbox_cond);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->lock);
    free(c->local);
    free(c->remote);
    free(c->url);
    free(c->instance);
    free(c->prefix);
    free(c);
}

/* ---- reading -------------------------------------------------------------------------------- */

int km_cluster_add_remote_load(km_cluster *c, uint32_t worker, km_active_load *load)
{
    if (!c || !load)
        return KM_ERR_NULL_POINTER;
    if (worker >= c->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    pthread_mutex_lock(&c->lock);
    load_add(load, &c->remote[worker]);
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

uint32_t km_cluster_remote_prefix_sharers(km_cluster *c, uint32_t worker, uint64_t prefix_key)
{
    if (!c || worker >= c->cfg.max_workers || !prefix_key)
        return 0;
    pthread_mutex_lock(&c->lock);
    const uint64_t *n = km_u64map_find(&c->remote_prefixes, work_slot(worker, prefix_key));
    uint32_t sharers = n ? (*n > UINT32_MAX ? UINT32_MAX : (uint32_t)*n) : 0;
    pthread_mutex_unlock(&c->lock);
    return sharers;
}

uint32_t km_cluster_remote_queued_depth(km_cluster *c, uint32_t worker, const uint64_t *hashes,
                                        uint32_t n, uint32_t from)
{
    if (!c || (n && !hashes) || worker >= c->cfg.max_workers || from > n)
        return 0;
    pthread_mutex_lock(&c->lock);
    uint32_t depth = from;
    while (depth < n && km_u64map_find(&c->remote_queued, work_slot(worker, hashes[depth])))
        depth++;
    pthread_mutex_unlock(&c->lock);
    return depth;
}

int km_cluster_get_view(km_cluster *c, uint64_t now, km_cluster_view *out)
{
    if (!c || !out)
        return KM_ERR_NULL_POINTER;
    memset(out, 0, sizeof *out);
    out->oldest_age_ms = NAN;
    pthread_mutex_lock(&c->lock);
    expire_silent(c, now);
    uint64_t oldest = UINT64_MAX;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++) {
        const contribution *p = &c->peers[i];
        if (!p->used)
            continue;
        out->instances++;
        if (p->last_heard_ns < oldest)
            oldest = p->last_heard_ns;
        if (p->stale) {
            if (out->n_stale < 8)
                memcpy(out->stale[out->n_stale], p->id, sizeof out->stale[0]);
            out->n_stale++;
        }
    }
    if (out->instances)
        out->oldest_age_ms = now > oldest ? (double)(now - oldest) / 1e6 : 0.0;
    out->scope = (c->connected && c->synced) || out->instances ? "cluster" : "this_instance";
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_get_stats(km_cluster *c, km_cluster_stats *out)
{
    if (!c || !out)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&c->lock);
    *out = c->st;
    out->connected = c->connected;
    out->synced = c->synced;
    out->instances = out->stale_instances = 0;
    out->remote_work = c->remote_work_held;
    for (uint32_t i = 0; i < KM_CLUSTER_MAX_INSTANCES; i++) {
        const contribution *p = &c->peers[i];
        out->instances += p->used;
        out->stale_instances += p->used && p->stale;
        for (uint32_t k = 0; p->used && k < c->n_local_pools; k++) {
            if (!(p->mismatch >> k & 1u))
                continue;
            if (out->n_mismatched < 8) {
                uint64_t theirs = 0;
                for (uint32_t j = 0; j < p->n_pools; j++)
                    if (!strcmp(p->pools[j].name, c->local_pools[k].name))
                        theirs = p->pools[j].fingerprint;
                memcpy(out->mismatched[out->n_mismatched].instance, p->id, sizeof p->id);
                memcpy(out->mismatched[out->n_mismatched].pool, c->local_pools[k].name,
                       sizeof c->local_pools[k].name);
                out->mismatched[out->n_mismatched].theirs = theirs;
                out->mismatched[out->n_mismatched].ours = c->local_pools[k].fingerprint;
            }
            out->n_mismatched++;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_get_sent(km_cluster *c, uint64_t *incarnation, uint64_t *seq)
{
    if (!c || !incarnation || !seq)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&c->lock);
    *incarnation = c->incarnation;
    *seq = c->sent_seq;
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}

int km_cluster_get_applied(km_cluster *c, const char *instance, uint64_t *incarnation,
                           uint64_t *seq)
{
    if (!c || !instance || !incarnation || !seq)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&c->lock);
    const contribution *p = contribution_find(c, instance);
    if (p) {
        *incarnation = p->incarnation;
        *seq = p->last_seq;
    }
    pthread_mutex_unlock(&c->lock);
    return p ? KM_OK : KM_ERR_NOT_FOUND;
}

int km_cluster_set_drop_one_in(km_cluster *c, uint32_t drop_one_in)
{
    if (!c)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&c->lock);
    c->cfg.drop_one_in = drop_one_in;
    pthread_mutex_unlock(&c->lock);
    return KM_OK;
}
