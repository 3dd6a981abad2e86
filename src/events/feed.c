/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed (include/kvmatch/feed.h): per-worker seq tracking, gap / replay / restart
 * handling and recovery windows. docs/EVENTS.md ("The feed") states the rules this file
 * implements. A message's events become queued index updates in feed_updates.c, which also holds
 * km_feed_flush; the copies of live messages held while a replay runs are made in
 * feed_message.c, snapshots of the feed's state in feed_snapshot.c; the types they share are in
 * feed_internal.h.
 *
 * Invariants, per worker:
 *  - expected is the next seq to apply; every applied message had exactly seq == expected, so the
 *    worker's updates are queued in its engine's order.
 *  - buffer holds live messages with seq >= expected (ascending: SUB delivers in order and a
 *    restart empties it) while a replay is in flight, and is empty otherwise.
 *  - last_live is the seq of the last live message; a live seq at or below it can only come from a
 *    new publisher process (PUB/SUB neither duplicates nor reorders). */
#include "kvmatch/log.h"
#include "kvmatch/feed.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "events/engine_hash_map.h"
#include "base/log_level.h"
#include "base/enum_names.h"
#include "base/error_detail.h"
#include "kvmatch/hash.h"
#include "events/feed_internal.h"

/* ---- small helpers --------------------------------------------------------------------------- */

int km_feed_fail(km_feed *feed, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(feed->last_error, sizeof feed->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

static void feed_log(const km_feed *feed, const worker *w, const char *fmt, ...)
{
    char line[1024];
    size_t level = km_log_level_length(fmt);
    int n = snprintf(line, sizeof line, "%.*sfeed: worker %u (%s): ", (int)level, fmt, w->id,
                     w->name);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        vsnprintf(line + n, sizeof line - (size_t)n, fmt + level, ap);
    va_end(ap);
    if (feed->config.log)
        feed->config.log(feed->config.log_user, line);
    else
        fprintf(stderr, "kvmatch: %s\n", line + level);
}

uint64_t km_feed_clock_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

const char *km_feed_last_error(const km_feed *feed)
{
    return feed ? feed->last_error : "";
}

static const char *const state_names[] = {KM_FEED_STATE_LIST(KM_ENUM_NAME_ENTRY)};
static const char *const window_cause_names[] = {KM_FEED_WINDOW_CAUSE_LIST(KM_ENUM_NAME_ENTRY)};
static const char *const window_end_names[] = {KM_FEED_WINDOW_END_LIST(KM_ENUM_NAME_ENTRY)};
static const char *const refusal_names[] = {KM_FEED_REFUSAL_LIST(KM_ENUM_NAME_ENTRY)};

const char *km_feed_refusal_name(km_feed_refusal reason)
{
    return KM_ENUM_NAME(refusal_names, reason);
}

const char *km_feed_state_name(km_feed_state state)
{
    return KM_ENUM_NAME(state_names, state);
}

const char *km_feed_window_cause_name(km_feed_window_cause cause)
{
    return KM_ENUM_NAME(window_cause_names, cause);
}

const char *km_feed_window_end_name(km_feed_window_end end)
{
    return KM_ENUM_NAME(window_end_names, end);
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

void km_feed_config_init(km_feed_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->block_size = 16;
    cfg->degraded_policy = KM_FEED_DEGRADED_KEEP_FLAGGED;
    cfg->extra_keys_policy = KM_FEED_EXTRA_KEYS_SKIP;
    cfg->bootstrap_replay = true;
    cfg->max_buffered_messages = 10000;
    cfg->max_buffered_bytes = UINT64_C(256) << 20;
    cfg->max_windows = 64;
    cfg->max_queued_hashes = UINT64_C(1) << 24;
    cfg->replay_dedup_window = 1024;
    cfg->offload_chunk_blocks = 1;
}

int km_feed_create(km_index *index, const km_feed_config *cfg_in, km_feed **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    if (!index)
        return KM_ERR_NULL_POINTER;
    km_feed_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        km_feed_config_init(&cfg);
    if (cfg.block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    if (cfg.hash_lookahead_tokens > KM_HASH_MAX_LOOKAHEAD)
        return KM_ERR_INVALID_ARGUMENT;
    if (cfg.offload_chunk_blocks > KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS)
        return KM_ERR_INVALID_ARGUMENT;
    if (cfg.offload_chunk_blocks == 0)
        cfg.offload_chunk_blocks = 1;
    if (cfg.max_buffered_messages == 0 || cfg.max_buffered_bytes == 0 || cfg.max_windows == 0 ||
        cfg.max_queued_hashes == 0 || cfg.replay_dedup_window == 0 ||
        (unsigned)cfg.degraded_policy > KM_FEED_DEGRADED_DROP ||
        (unsigned)cfg.extra_keys_policy > KM_FEED_EXTRA_KEYS_IGNORE)
        return KM_ERR_INVALID_ARGUMENT;
    km_feed *feed = calloc(1, sizeof *feed);
    if (!feed)
        return KM_ERR_OUT_OF_MEMORY;
    feed->index = index;
    feed->config = cfg;
    *out = feed;
    return KM_OK;
}

static void buffer_clear(worker *w)
{
    for (uint32_t i = 0; i < w->buffer_count; i++)
        free(w->buffer[(w->buffer_head + i) % w->buffer_capacity]);
    w->buffer_head = w->buffer_count = 0;
    w->buffer_bytes = 0;
}

worker *km_feed_worker_new(const km_feed *feed)
{
    worker *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    km_emap_init(&w->map, feed->config.offload_chunk_blocks > 1);
    w->history = calloc(feed->config.max_windows, sizeof *w->history);
    if (!w->history) {
        km_feed_worker_free(w);
        return NULL;
    }
    return w;
}

void km_feed_worker_free(worker *w)
{
    if (!w)
        return;
    buffer_clear(w);
    free(w->buffer);
    km_emap_free(&w->map);
    free(w->dedup);
    free(w->history);
    free(w);
}

void km_feed_destroy(km_feed *feed)
{
    if (!feed)
        return;
    for (uint32_t i = 0; i < feed->n_workers; i++)
        km_feed_worker_free(feed->workers[i]);
    free(feed->workers);
    free(feed->actions);
    free(feed->queue);
    free(feed->groups);
    free(feed->hashes);
    free(feed->new_keys);
    free(feed->tier_scratch);
    free(feed->tier_chains);
    free(feed->scratch);
    free(feed->rule_clears);
    free(feed->taken.queue);
    free(feed->taken.groups);
    free(feed->taken.hashes);
    free(feed->taken.new_keys);
    free(feed->taken.scratch);
    free(feed->taken.positions);
    free(feed->taken.window_blocks);
    free(feed);
}

/* ---- worker lookup --------------------------------------------------------------------------- */

static uint32_t worker_slot(const km_feed *feed, uint32_t id, bool *found)
{
    /* Ids are unique and ascending, so a worker whose id equals its position is the one; workers
     * numbered 0, 1, ... (the usual fleet) are found without the search. */
    if (id < feed->n_workers && feed->workers[id]->id == id) {
        *found = true;
        return id;
    }
    uint32_t lo = 0, hi = feed->n_workers;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (feed->workers[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < feed->n_workers && feed->workers[lo]->id == id;
    return lo;
}

int km_feed_check_maps(const km_feed *feed, char *why, size_t why_size)
{
    bool keep_parents = feed->config.offload_chunk_blocks > 1;
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        const worker *w = feed->workers[i];
        char detail[160];
        int rc = w->map.keep_parents == keep_parents
                     ? km_emap_check(&w->map, detail, sizeof detail)
                     : (snprintf(detail, sizeof detail, "keeps parents %d, the feed walks %d",
                                 w->map.keep_parents, keep_parents),
                        KM_ERR_INTERNAL);
        if (rc != KM_OK) {
            snprintf(why, why_size, "worker %u: %s", w->id, detail);
            return rc;
        }
    }
    return KM_OK;
}

worker *km_feed_find_worker(const km_feed *feed, uint32_t id)
{
    bool found;
    uint32_t slot = worker_slot(feed, id, &found);
    return found ? feed->workers[slot] : NULL;
}

/* ---- actions --------------------------------------------------------------------------------- */

/* Actions are tiny and few; when even one cannot be queued, start_replay treats the request as
 * failed at once and cancel_replay relies on the transport's timeout. */
static int push_action(km_feed *feed, km_feed_action a)
{
    if (feed->actions_count == feed->actions_capacity) {
        size_t cap = feed->actions_capacity ? feed->actions_capacity * 2 : 16;
        km_feed_action *fresh = malloc(cap * sizeof *fresh);
        if (!fresh)
            return KM_ERR_OUT_OF_MEMORY;
        for (size_t i = 0; i < feed->actions_count; i++)
            fresh[i] = feed->actions[(feed->actions_head + i) % feed->actions_capacity];
        free(feed->actions);
        feed->actions = fresh;
        feed->actions_head = 0;
        feed->actions_capacity = cap;
    }
    feed->actions[(feed->actions_head + feed->actions_count) % feed->actions_capacity] = a;
    feed->actions_count++;
    return KM_OK;
}

int km_feed_next_action(km_feed *feed, km_feed_action *out)
{
    if (!feed || !out || feed->actions_count == 0)
        return 0;
    *out = feed->actions[feed->actions_head];
    feed->actions_head = (feed->actions_head + 1) % feed->actions_capacity;
    feed->actions_count--;
    return 1;
}

/* ---- windows --------------------------------------------------------------------------------- */

void km_feed_window_init(km_feed_window *win, km_feed_window_cause cause, uint64_t now,
                                uint64_t from_seq)
{
    memset(win, 0, sizeof *win);
    win->cause = cause;
    win->end = KM_FEED_END_OPEN;
    win->start_ns = now;
    win->from_seq = from_seq;
}

static void history_push(const km_feed *feed, worker *w, const km_feed_window *win)
{
    uint32_t cap = feed->config.max_windows;
    if (!w->history)
        return; /* allocated at add time; NULL only if that failed, then history is not kept */
    if (w->history_count < cap) {
        w->history[(w->history_head + w->history_count) % cap] = *win;
        w->history_count++;
    } else {
        w->history[w->history_head] = *win;
        w->history_head = (w->history_head + 1) % cap;
    }
}

static void window_close(const km_feed *feed, worker *w, km_feed_window *win, uint64_t now,
                         km_feed_window_end end)
{
    win->end = end;
    win->end_ns = now < win->start_ns ? win->start_ns : now;
    win->duration_ns = win->end_ns - win->start_ns;
    history_push(feed, w, win);
}

void km_feed_open_recovery(worker *w, km_feed_window_cause cause, uint64_t now,
                                  uint64_t from_seq)
{
    if (w->recovery_open)
        return; /* one recovery at a time: a gap during a restart's replay belongs to the restart */
    km_feed_window_init(&w->recovery, cause, now, from_seq);
    w->recovery_open = true;
    w->windows_total++;
}

static void close_recovery(const km_feed *feed, worker *w, uint64_t now, km_feed_window_end end)
{
    if (!w->recovery_open)
        return;
    w->recovery_open = false;
    window_close(feed, w, &w->recovery, now, end);
}

void km_feed_exit_degraded(const km_feed *feed, worker *w, uint64_t now,
                                  km_feed_window_end end)
{
    if (!w->degraded)
        return;
    w->degraded = false;
    if (w->degraded_open) {
        w->degraded_open = false;
        window_close(feed, w, &w->degraded_window, now, end);
    }
    feed_log(feed, w, KM_LOG_INFO "DEGRADED ended (%s)", km_feed_window_end_name(end));
}

/* History was lost (or refused by the index): the worker's index is incomplete. */
void km_feed_enter_degraded(km_feed *feed, worker *w, uint64_t now, const char *why)
{
    if (!w->degraded) {
        w->degraded = true;
        km_feed_window_init(&w->degraded_window, KM_FEED_WINDOW_DEGRADED, now, 0);
        w->degraded_open = true;
        w->windows_total++;
        feed_log(feed, w, KM_LOG_WARNING "DEGRADED: %s", why);
    }
    /* DROP forgets the engine-hash map with the index: its media bits may be stale too (a lost
     * BlockRemoved), and a held entry keeps its chain on a later store (apply_stored), so a stale
     * bit would keep a block indexed after its last real removal. Blocks whose parents were
     * forgotten are skipped until a sequence starts again, as after a clear. */
    if (feed->config.degraded_policy == KM_FEED_DEGRADED_DROP) {
        if (km_feed_queue_control(feed, w, KM_UPDATE_CLEAR_WORKER) != KM_OK)
            feed_log(feed, w, KM_LOG_ERROR "out of memory queueing the DROP-policy clear");
        else
            km_emap_clear(&w->map);
    }
}

static void declare_lost(km_feed *feed, worker *w, uint64_t n, uint64_t now)
{
    if (n == 0)
        return;
    w->lost_from[w->lost_next] = w->expected;
    w->lost_to[w->lost_next] = w->expected + n;
    w->lost_next = (w->lost_next + 1) % LOST_RANGES;
    if (w->lost_count < LOST_RANGES)
        w->lost_count++;
    w->c.lost += n;
    if (w->recovery_open)
        w->recovery.lost += n;
    if (w->degraded_open)
        w->degraded_window.lost += n;
    char why[96];
    snprintf(why, sizeof why, "%" PRIu64 " message(s) lost before seq %" PRIu64, n, w->expected + n);
    km_feed_enter_degraded(feed, w, now, why);
}

/* ---- the replay dedup window ----------------------------------------------------------------- */

static void dedup_remember(const km_feed *feed, worker *w, uint64_t seq, uint64_t digest)
{
    uint32_t size = feed->config.replay_dedup_window;
    if (!w->dedup) {
        w->dedup = malloc((size_t)size * sizeof *w->dedup);
        if (!w->dedup)
            return; /* without it a late duplicate reads as a restart: safe, only costly */
        for (uint32_t i = 0; i < size; i++)
            w->dedup[i].seq = UINT64_MAX;
    }
    dedup_slot *s = &w->dedup[seq % size];
    s->seq = seq;
    s->digest = digest;
}

static bool dedup_matches(const km_feed *feed, const worker *w, uint64_t seq, uint64_t digest)
{
    if (!w->dedup)
        return false;
    const dedup_slot *s = &w->dedup[seq % feed->config.replay_dedup_window];
    return s->seq == seq && s->digest == digest;
}

static void dedup_clear(const km_feed *feed, worker *w)
{
    if (w->dedup)
        for (uint32_t i = 0; i < feed->config.replay_dedup_window; i++)
            w->dedup[i].seq = UINT64_MAX;
    w->lost_count = w->lost_next = 0;
}

static bool was_lost(const worker *w, uint64_t seq)
{
    for (uint32_t i = 0; i < w->lost_count; i++)
        if (seq >= w->lost_from[i] && seq < w->lost_to[i])
            return true;
    return false;
}

/* ---- applying one message -------------------------------------------------------------------- */

/* Apply the message with seq == w->expected: consume the seq, queue its updates as one group. */
static void apply_message(km_feed *feed, worker *w, uint64_t seq, const message_view *v,
                          bool from_replay, uint64_t now)
{
    w->expected = seq + 1;
    w->has_expected = true;
    if (from_replay) {
        w->c.replayed++;
        if (w->recovery_open)
            w->recovery.replayed++;
        dedup_remember(feed, w, seq, km_feed_message_digest(v));
    }
    if (v->malformed)
        return;
    w->last_engine_timestamp = v->timestamp;
    km_feed_queue_message(feed, w, v, now);
}

/* ---- replay and the live buffer -------------------------------------------------------------- */

static held_message *buffer_front(const worker *w)
{
    return w->buffer_count ? w->buffer[w->buffer_head] : NULL;
}

static void buffer_pop(worker *w)
{
    held_message *m = w->buffer[w->buffer_head];
    w->buffer_bytes -= m->bytes;
    free(m);
    w->buffer_head = (w->buffer_head + 1) % w->buffer_capacity;
    w->buffer_count--;
}

static km_feed_state worker_state(const worker *w)
{
    if (!w->has_expected || w->replay == REPLAY_BOOTSTRAP || w->replay == REPLAY_RESYNC)
        return KM_FEED_STATE_SYNCING;
    if (w->degraded)
        return KM_FEED_STATE_DEGRADED;
    if (w->replay == REPLAY_GAP ||
        (w->recovery_open && w->recovery.cause == KM_FEED_WINDOW_RESUME))
        return KM_FEED_STATE_GAP;
    return KM_FEED_STATE_LIVE;
}

/* Close the recovery window once the stream position is known and no replay is running. */
static void settle(km_feed *feed, worker *w, uint64_t now)
{
    if (w->replay != REPLAY_NONE || !w->has_expected || !w->recovery_open)
        return;
    km_feed_window_end end = w->recovery.lost ? KM_FEED_END_LOST : KM_FEED_END_RECOVERED;
    close_recovery(feed, w, now, end);
}

static void cancel_replay(km_feed *feed, worker *w)
{
    if (w->replay == REPLAY_NONE)
        return;
    km_feed_action a = {KM_FEED_ACTION_REPLAY_CANCEL, w->id, w->replay_id, 0};
    push_action(feed, a); /* if this fails, the transport's timeout ends the request anyway */
    w->replay = REPLAY_NONE;
}

static void start_replay(km_feed *feed, worker *w, replay_kind kind, uint64_t from, uint64_t now)
{
    if (kind == REPLAY_GAP)
        km_feed_open_recovery(w, KM_FEED_WINDOW_GAP, now, from);
    uint64_t id = ++feed->next_request_id;
    km_feed_action a = {KM_FEED_ACTION_REPLAY_REQUEST, w->id, id, from};
    if (push_action(feed, a) != KM_OK) {
        /* Could not even ask: behave as if the request had failed at once. */
        w->c.replay_failures++;
        return;
    }
    w->replay = kind;
    w->replay_id = id;
    w->replay_from = from;
    w->replay_progress = false;
    w->replay_answered = false;
    w->replay_refusal_logged = false;
    w->c.replay_requests++;
    if (w->recovery_open)
        w->recovery.replay_requests++;
    feed_log(feed, w, KM_LOG_INFO "replay request %" PRIu64 " from seq %" PRIu64 " (%s)", id, from,
             kind == REPLAY_GAP ? "gap" : kind == REPLAY_BOOTSTRAP ? "bootstrap" : "resync");
}

/* Apply buffered live messages in order. A hole before the next buffered message is either lost
 * (holes_lost) or asked for with a new replay. */
static void drain(km_feed *feed, worker *w, bool holes_lost, uint64_t now)
{
    held_message *m;
    while ((m = buffer_front(w))) {
        if (m->seq < w->expected) {
            w->c.duplicates++;
            buffer_pop(w);
            continue;
        }
        if (m->seq > w->expected) {
            if (!holes_lost && w->has_replay) {
                w->c.gaps++;
                start_replay(feed, w, REPLAY_GAP, w->expected, now);
                if (w->replay != REPLAY_NONE)
                    return;
            }
            declare_lost(feed, w, m->seq - w->expected, now);
            w->expected = m->seq;
        }
        message_view v = km_feed_view_of_held(m);
        apply_message(feed, w, m->seq, &v, false, now);
        buffer_pop(w);
    }
    settle(feed, w, now);
}

/* The replay in flight will not complete (it failed, or the live buffer overflowed): what it has
 * not given is lost, except before a stream position exists (bootstrap / resync), where the stream
 * simply starts at the first live message held. */
static void abandon_replay(km_feed *feed, worker *w, bool send_cancel, uint64_t now)
{
    if (send_cancel)
        cancel_replay(feed, w);
    w->replay = REPLAY_NONE;
    w->c.replay_failures++;
    if (!w->has_expected) {
        held_message *m = buffer_front(w);
        if (!m) {
            settle(feed, w, now);
            return;
        }
        w->c.history_unavailable += m->seq;
        w->has_expected = true;
        w->expected = m->seq;
    }
    drain(feed, w, true, now);
}

static int buffer_push(const km_feed *feed, worker *w, uint64_t seq, const km_kv_batch *batch)
{
    if (w->buffer_count >= feed->config.max_buffered_messages)
        return KM_ERR_TOO_LARGE;
    if (w->buffer_count == w->buffer_capacity) {
        uint32_t cap = w->buffer_capacity ? w->buffer_capacity * 2 : 16;
        if (cap > feed->config.max_buffered_messages)
            cap = feed->config.max_buffered_messages;
        held_message **fresh = malloc((size_t)cap * sizeof *fresh);
        if (!fresh)
            return KM_ERR_OUT_OF_MEMORY;
        for (uint32_t i = 0; i < w->buffer_count; i++)
            fresh[i] = w->buffer[(w->buffer_head + i) % w->buffer_capacity];
        free(w->buffer);
        w->buffer = fresh;
        w->buffer_head = 0;
        w->buffer_capacity = cap;
    }
    held_message *m = km_feed_held_copy(seq, batch);
    if (!m)
        return KM_ERR_OUT_OF_MEMORY;
    if (w->buffer_bytes + m->bytes > feed->config.max_buffered_bytes) {
        free(m);
        return KM_ERR_TOO_LARGE;
    }
    w->buffer[(w->buffer_head + w->buffer_count) % w->buffer_capacity] = m;
    w->buffer_count++;
    w->buffer_bytes += m->bytes;
    return KM_OK;
}

/* A live message that passed the restart / duplicate checks. */
static void deliver_live(km_feed *feed, worker *w, uint64_t seq, const km_kv_batch *batch,
                         uint64_t now)
{
    if (w->replay != REPLAY_NONE) {
        if (buffer_push(feed, w, seq, batch) == KM_OK)
            return;
        /* Overflow (or no memory to hold it): give up on the replay; what it had not yet given
         * is lost. Then take this message as if no replay had been running. */
        w->c.buffer_overflows++;
        feed_log(feed, w, KM_LOG_WARNING
                 "live buffer full (%u messages) during replay %" PRIu64 ": abandoning it",
                 w->buffer_count, w->replay_id);
        abandon_replay(feed, w, true, now);
    }
    if (!w->has_expected) {
        /* First message without a bootstrap replay: it defines the stream position. */
        w->c.history_unavailable += seq;
        w->has_expected = true;
        w->expected = seq;
    }
    message_view v = km_feed_view_of_batch(batch);
    if (seq > w->expected) {
        w->c.gaps++;
        if (w->has_replay) {
            feed_log(feed, w, KM_LOG_WARNING
                     "gap: expected seq %" PRIu64 ", got %" PRIu64, w->expected, seq);
            start_replay(feed, w, REPLAY_GAP, w->expected, now);
            if (w->replay != REPLAY_NONE && buffer_push(feed, w, seq, batch) == KM_OK)
                return;
            if (w->replay != REPLAY_NONE) { /* no memory to hold even this one message */
                cancel_replay(feed, w);
                w->c.replay_failures++;
            }
        } else {
            km_feed_open_recovery(w, KM_FEED_WINDOW_GAP, now, w->expected);
        }
        declare_lost(feed, w, seq - w->expected, now);
        w->expected = seq;
    }
    apply_message(feed, w, seq, &v, false, now);
    settle(feed, w, now);
}

/* seq went back: a new engine process. Its predecessor's KV died with it. */
static void restart_worker(km_feed *feed, worker *w, uint64_t seq, uint64_t now)
{
    w->c.restarts++;
    feed_log(feed, w, KM_LOG_WARNING
             "restart: seq %" PRIu64 " after %s %" PRIu64 "; dropping its blocks", seq,
             w->has_expected ? "expected" : "last", w->has_expected ? w->expected : w->last_live);
    cancel_replay(feed, w);
    buffer_clear(w);
    close_recovery(feed, w, now, KM_FEED_END_RESTART);
    km_feed_exit_degraded(feed, w, now, KM_FEED_END_RESTART);
    if (km_feed_queue_control(feed, w, KM_UPDATE_CLEAR_WORKER) != KM_OK)
        km_feed_enter_degraded(feed, w, now, "out of memory queueing the restart's clear");
    km_emap_clear(&w->map);
    w->gpu_groups = w->window_groups = 0;
    dedup_clear(feed, w);
    w->stores_applied = w->stores_refused_for_config = 0;
    km_feed_open_recovery(w, KM_FEED_WINDOW_RESTART, now, seq);
    w->has_expected = true;
    w->expected = 0; /* a new publisher starts at 0: anything before seq is a gap */
}

/* A restored worker added again with the same identity: resume from its saved position. */
static int claim_restored(km_feed *feed, worker *w, const km_feed_worker_config *cfg, uint64_t now)
{
    w->awaiting_claim = false;
    w->has_replay = cfg->has_replay;
    snprintf(w->name, sizeof w->name, "%s", cfg->name ? cfg->name : "");
    if (!w->has_expected) {
        /* Saved before its stream position was known: bootstrap as a new worker would. */
        if (feed->config.bootstrap_replay && w->has_replay)
            start_replay(feed, w, REPLAY_BOOTSTRAP, 0, now);
    } else if (w->has_replay) {
        feed_log(feed, w, KM_LOG_INFO
                 "resuming from seq %" PRIu64 " (restart of kvmatch)", w->expected);
        start_replay(feed, w, REPLAY_GAP, w->expected, now);
    }
    feed->last_error[0] = '\0';
    return KM_OK;
}

/* ---- public inputs --------------------------------------------------------------------------- */

int km_feed_add_worker(km_feed *feed, const km_feed_worker_config *cfg, uint64_t now_ns)
{
    return km_feed_add_worker_identity(feed, cfg, NULL, now_ns);
}

int km_feed_add_worker_identity(km_feed *feed, const km_feed_worker_config *cfg,
                                const char *identity_in, uint64_t now_ns)
{
    if (!feed || !cfg)
        return KM_ERR_NULL_POINTER;
    /* The id range only: a worker is added on the subscriber's I/O thread while a flush may be
     * applying (km_feed_flush_apply), so nothing else of the index is read here. */
    if (cfg->worker >= km_index_max_workers(feed->index))
        return km_feed_fail(feed, KM_ERR_WORKER_RANGE,
                            "worker %u is outside the index", cfg->worker);
    bool found;
    uint32_t slot = worker_slot(feed, cfg->worker, &found);
    const char *identity = identity_in ? identity_in : cfg->name ? cfg->name : "";
    if (found && feed->workers[slot]->awaiting_claim) {
        worker *r = feed->workers[slot];
        if (strncmp(r->identity, identity, KM_FEED_NAME_MAX - 1) == 0)
            return claim_restored(feed, r, cfg, now_ns);
        /* Another producer under this id: forget the restored state and start afresh. */
        feed_log(feed, r, KM_LOG_WARNING
                 "restored identity \"%s\" differs from \"%s\": starting afresh",
                 r->identity, identity);
        if (km_feed_queue_control(feed, r, KM_UPDATE_CLEAR_WORKER) != KM_OK)
            return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "update queue");
        memmove(feed->workers + slot, feed->workers + slot + 1,
                (size_t)(feed->n_workers - slot - 1) * sizeof *feed->workers);
        feed->n_workers--;
        km_feed_worker_free(r);
        found = false;
    }
    if (found)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT,
                            "worker %u is already followed", cfg->worker);
    if (GROW(feed->workers, feed->workers_capacity, (size_t)feed->n_workers + 1))
        return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "worker table");
    worker *w = km_feed_worker_new(feed);
    if (!w)
        return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "worker state");
    w->id = cfg->worker;
    w->generation = ++feed->next_generation;
    /* The index may still hold a removed worker's rule under this id (it is cleared with that
     * worker's blocks): this worker's own rule replaces it at its first sync. */
    w->index_rule_failed = true;
    snprintf(w->name, sizeof w->name, "%s", cfg->name ? cfg->name : "");
    snprintf(w->identity, sizeof w->identity, "%s", identity);
    w->has_replay = cfg->has_replay;
    if (km_feed_queue_control(feed, w, KM_UPDATE_CLEAR_WORKER) != KM_OK) {
        km_feed_worker_free(w);
        return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "update queue");
    }
    memmove(feed->workers + slot + 1, feed->workers + slot,
            (size_t)(feed->n_workers - slot) * sizeof *feed->workers);
    feed->workers[slot] = w;
    feed->n_workers++;
    km_feed_open_recovery(w, KM_FEED_WINDOW_STARTUP, now_ns, 0);
    if (feed->config.bootstrap_replay && w->has_replay)
        start_replay(feed, w, REPLAY_BOOTSTRAP, 0, now_ns);
    feed->last_error[0] = '\0';
    return KM_OK;
}

int km_feed_remove_worker(km_feed *feed, uint32_t id, uint64_t now_ns)
{
    (void)now_ns;
    if (!feed)
        return KM_ERR_NULL_POINTER;
    bool found;
    uint32_t slot = worker_slot(feed, id, &found);
    if (!found)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "worker %u is not followed", id);
    worker *w = feed->workers[slot];
    if (w->index_window_groups || w->index_rule_failed) {
        /* Its rule goes with its blocks, at the next flush. */
        if (GROW(feed->rule_clears, feed->rule_clear_capacity, feed->rule_clear_count + 1))
            return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "window rule clears");
        feed->rule_clears[feed->rule_clear_count++] = id;
    }
    int rc = km_feed_queue_control(feed, w, KM_UPDATE_REMOVE_WORKER);
    if (rc)
        return km_feed_fail(feed, rc, "update queue");
    cancel_replay(feed, w);
    memmove(feed->workers + slot, feed->workers + slot + 1,
            (size_t)(feed->n_workers - slot - 1) * sizeof *feed->workers);
    feed->n_workers--;
    km_feed_worker_free(w);
    feed->last_error[0] = '\0';
    return KM_OK;
}

int km_feed_resync_worker(km_feed *feed, uint32_t id, uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    worker *w = km_feed_find_worker(feed, id);
    if (!w)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "worker %u is not followed", id);
    int rc = km_feed_queue_control(feed, w, KM_UPDATE_CLEAR_WORKER);
    if (rc)
        return km_feed_fail(feed, rc, "update queue");
    feed_log(feed, w, KM_LOG_INFO "resync requested");
    cancel_replay(feed, w);
    buffer_clear(w);
    close_recovery(feed, w, now_ns, KM_FEED_END_RESYNC);
    km_feed_exit_degraded(feed, w, now_ns, KM_FEED_END_RESYNC);
    km_emap_clear(&w->map);
    w->gpu_groups = w->window_groups = 0;
    dedup_clear(feed, w);
    w->stores_applied = w->stores_refused_for_config = 0;
    w->has_expected = false;
    km_feed_open_recovery(w, KM_FEED_WINDOW_RESYNC, now_ns, 0);
    if (w->has_replay)
        start_replay(feed, w, REPLAY_RESYNC, 0, now_ns);
    feed->last_error[0] = '\0';
    return KM_OK;
}

/* ---- refused events -------------------------------------------------------------------------- */

/* At most one refusal log line per worker per interval: an engine configured with another block
 * size refuses every store, and a line per event would drown the log. */
#define REFUSAL_LOG_INTERVAL_NS UINT64_C(10000000000)

void km_feed_count_refusal(worker *w, km_feed_refusal reason, uint64_t n, const char *example)
{
    if ((unsigned)reason >= KM_FEED_REFUSAL_COUNT || n == 0)
        return;
    w->c.refused[reason] += n;
    if (example)
        snprintf(w->refusal_example, sizeof w->refusal_example, "%s", example);
}

/* The refusals of a decoded message (decoder-level reasons) or of one that did not decode
 * (batch NULL; `why` the decoder's reason, NULL when not known). */
static void count_message_refusals(worker *w, const km_kv_batch *batch, const char *why)
{
    if (!batch) {
        w->c.malformed++;
        char example[KM_FEED_REFUSAL_EXAMPLE_MAX];
        snprintf(example, sizeof example, "a message that did not decode%s%s",
                 why && *why ? ": " : "", why && *why ? why : "");
        km_feed_count_refusal(w, KM_FEED_REFUSED_UNDECODABLE, 1, example);
        return;
    }
    w->c.rejected_events += batch->n_rejected;
    w->c.unknown_events += batch->n_unknown_events;
    for (uint32_t i = 0; i < batch->n_rejected; i++) {
        const km_kv_rejected_event *r = &batch->rejected[i];
        km_feed_refusal reason = r->reason == KM_KV_REJECTED_TOKEN_COUNT ? KM_FEED_REFUSED_TOKEN_COUNT
                                 : r->reason == KM_KV_REJECTED_BLOCK_SIZE
                                     ? KM_FEED_REFUSED_BLOCK_SIZE
                                     : KM_FEED_REFUSED_INVALID_EVENT;
        km_feed_count_refusal(w, reason, 1, r->message);
        if (reason == KM_FEED_REFUSED_BLOCK_SIZE)
            w->stores_refused_for_config++;
    }
    if (batch->n_unknown_events) {
        char example[96];
        snprintf(example, sizeof example, "event type \"%s\"",
                 batch->first_unknown_type ? batch->first_unknown_type : "?");
        km_feed_count_refusal(w, KM_FEED_REFUSED_UNKNOWN_TYPE, batch->n_unknown_events, example);
    }
}

static void log_fresh_refusals(const km_feed *feed, worker *w, uint64_t now);

/* One log line naming the worker and, per reason, the refusals since the previous line; at most
 * one per REFUSAL_LOG_INTERVAL_NS per worker (the counters keep counting meanwhile). Without
 * fresh refusals, only the counters are compared. */
static inline void log_refusals(const km_feed *feed, worker *w, uint64_t now)
{
    if (w->has_refusal_log && now - w->refusal_log_ns < REFUSAL_LOG_INTERVAL_NS)
        return;
    uint64_t fresh = 0;
    for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT; r++)
        fresh |= w->c.refused[r] ^ w->refusals_logged[r];
    if (fresh)
        log_fresh_refusals(feed, w, now);
}

/* log_refusals, when some counter moved since the previous line. */
static void log_fresh_refusals(const km_feed *feed, worker *w, uint64_t now)
{
    char list[384];
    size_t used = 0;
    list[0] = '\0';
    for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT; r++) {
        uint64_t fresh = w->c.refused[r] - w->refusals_logged[r];
        if (!fresh || used >= sizeof list)
            continue;
        int n = snprintf(list + used, sizeof list - used, "%s%s %" PRIu64, used ? ", " : "",
                         km_feed_refusal_name((km_feed_refusal)r), fresh);
        used += n > 0 ? (size_t)n : 0;
    }
    if (!list[0])
        return;
    memcpy(w->refusals_logged, w->c.refused, sizeof w->refusals_logged);
    w->has_refusal_log = true;
    w->refusal_log_ns = now;
    feed_log(feed, w, KM_LOG_WARNING
             "refused or skipped events: %s (latest: %s)%s", list, w->refusal_example,
             w->stores_refused_for_config && !w->stores_applied
                 ? "; every store refused for its block size: the engine's block size is not "
                   "the pool's"
                 : "");
}

/* Is the seq of a live message the decoder rejected that message's place in the stream? Only when
 * it is exactly where the next live message belongs: right after the last live seq (SUB delivers
 * in order), or, before any live message, the next seq to apply. Any other value read from frames
 * that did not decode may be garbage, and taking it could make the next healthy message look like
 * a gap or an engine restart. Written so that nothing wraps. */
static bool rejected_live_seq_fits(const worker *w, uint64_t seq)
{
    if (w->has_last_live)
        return seq > w->last_live && seq - w->last_live == 1;
    return w->has_expected && seq == w->expected;
}

static int live_message(km_feed *feed, uint32_t id, uint64_t seq, const km_kv_batch *batch,
                        const char *why, uint64_t now_ns);

int km_feed_live(km_feed *feed, uint32_t id, uint64_t seq, const km_kv_batch *batch, uint64_t now_ns)
{
    return live_message(feed, id, seq, batch, NULL, now_ns);
}

int km_feed_live_undecodable(km_feed *feed, uint32_t id, uint64_t seq, const char *why,
                             uint64_t now_ns)
{
    return live_message(feed, id, seq, NULL, why, now_ns);
}

/* km_feed_live; `why`: the decoder's reason when batch is NULL. */
static int live_message(km_feed *feed, uint32_t id, uint64_t seq, const km_kv_batch *batch,
                        const char *why, uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    worker *w = km_feed_find_worker(feed, id);
    if (!w)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "worker %u is not followed", id);
    w->c.messages++;
    w->has_last_receive = true;
    w->last_receive_ns = now_ns;
    if (seq == KM_KV_REPLAY_END_SEQ) {
        /* the replay end marker's seq, never a message's */
        count_message_refusals(w, NULL, batch ? "seq 2^64-1 (the replay end marker's) on a live "
                                                "message" : why);
        log_refusals(feed, w, now_ns);
        return KM_OK;
    }
    count_message_refusals(w, batch, why);
    if (!batch && !rejected_live_seq_fits(w, seq)) {
        log_refusals(feed, w, now_ns);
        return KM_OK; /* a gap or restart behind it shows at the next healthy message */
    }

    bool restart = false;
    if (w->has_last_live && seq <= w->last_live) {
        restart = true; /* SUB never repeats or reorders: a new publisher */
    } else if (w->has_expected && seq < w->expected) {
        /* Seen before only through a replay: a late live copy of a replayed message (the sockets
         * are not ordered with each other), or a new publisher. The content tells them apart. */
        message_view v = km_feed_view_of_batch(batch);
        bool late_lost = was_lost(w, seq);
        if (late_lost || !batch || dedup_matches(feed, w, seq, km_feed_message_digest(&v))) {
            w->has_last_live = true;
            w->last_live = seq;
            w->last_live_restored = false;
            if (late_lost)
                w->c.late_lost++;
            else
                w->c.duplicates++;
            return KM_OK;
        }
        restart = true;
    }
    w->has_last_live = true;
    w->last_live = seq;
    w->last_live_restored = false;
    if (restart)
        restart_worker(feed, w, seq, now_ns);
    deliver_live(feed, w, seq, batch, now_ns);
    log_refusals(feed, w, now_ns);
    return KM_OK;
}

int km_feed_malformed(km_feed *feed, uint32_t id, km_kv_source source, const char *why,
                      uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    worker *w = km_feed_find_worker(feed, id);
    if (!w)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "worker %u is not followed", id);
    if (source == KM_KV_SOURCE_SUBSCRIBER)
        w->c.messages++; /* live messages, malformed included */
    count_message_refusals(w, NULL, why);
    w->has_last_receive = true;
    w->last_receive_ns = now_ns;
    log_refusals(feed, w, now_ns);
    return KM_OK;
}

static worker *replay_worker(km_feed *feed, uint32_t id, uint64_t request_id, int *rc)
{
    worker *w = km_feed_find_worker(feed, id);
    if (!w) {
        *rc = km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "worker %u is not followed", id);
        return NULL;
    }
    *rc = KM_OK;
    if (w->replay == REPLAY_NONE || w->replay_id != request_id) {
        w->c.stale_replay_items++;
        return NULL;
    }
    return w;
}

/* Why a replay item must be refused, or NULL when it may be applied. A request from replay_from
 * returns the publisher's buffered messages with seq >= replay_from, consecutive and in order,
 * the first one later than asked when older history was evicted. What no such answer holds:
 *  - seq 2^64-1 (the end marker's) or a seq below the start;
 *  - a skip past the newest seq the live stream has shown (when it has shown one at or after the
 *    start, and not only before a restore: a restored one may be older than the engine's whole
 *    buffer now): the publisher had sent at most that far when it answered, unless the live
 *    socket lags by more than the whole replay buffer; declaring the seqs in between lost would
 *    then drop their live copies, still on their way, as late copies of lost seqs;
 *  - the same for the first item of a bootstrap or resync (no position yet), measured from the
 *    live messages held while this request runs (a last_live from before it, restored from a
 *    snapshot, may be older than the engine's whole buffer): taken, it would set the position
 *    past the live stream, whose next message would then read as an engine restart;
 *  - for a rejected payload (batch NULL): any seq but the next one to apply (its frames did not
 *    decode, so the seq may be garbage; one below it is a harmless duplicate). */
static const char *replay_item_refusal(const worker *w, uint64_t seq, bool decoded)
{
    if (seq == KM_KV_REPLAY_END_SEQ)
        return "seq 2^64-1 is the end marker's";
    if (seq < w->replay_from)
        return "below the requested start";
    if (!decoded && (!w->has_expected || seq > w->expected))
        return "a rejected payload's seq that is not the next to apply";
    /* Without a position, every live message is held while the replay runs, the newest last. */
    bool live_reference = w->has_expected ? seq > w->expected && !w->last_live_restored &&
                                                w->last_live >= w->replay_from
                                          : w->buffer_count > 0;
    if (live_reference && w->has_last_live && seq > w->last_live && seq - w->last_live > 1)
        return "skips past the newest live seq";
    return NULL;
}

static int replay_item(km_feed *feed, uint32_t id, uint64_t request_id, uint64_t seq,
                       const km_kv_batch *batch, const char *why, uint64_t now_ns);

int km_feed_replay_item(km_feed *feed, uint32_t id, uint64_t request_id, uint64_t seq,
                        const km_kv_batch *batch, uint64_t now_ns)
{
    int rc = replay_item(feed, id, request_id, seq, batch, NULL, now_ns);
    worker *w = feed ? km_feed_find_worker(feed, id) : NULL;
    if (w)
        log_refusals(feed, w, now_ns);
    return rc;
}

int km_feed_replay_item_undecodable(km_feed *feed, uint32_t id, uint64_t request_id,
                                    uint64_t seq, const char *why, uint64_t now_ns)
{
    int rc = replay_item(feed, id, request_id, seq, NULL, why, now_ns);
    worker *w = feed ? km_feed_find_worker(feed, id) : NULL;
    if (w)
        log_refusals(feed, w, now_ns);
    return rc;
}

/* km_feed_replay_item; `why`: the decoder's reason when batch is NULL. */
static int replay_item(km_feed *feed, uint32_t id, uint64_t request_id, uint64_t seq,
                       const km_kv_batch *batch, const char *why, uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    int rc;
    worker *w = replay_worker(feed, id, request_id, &rc);
    if (!w) {
        /* A stale item (its worker followed, its request over) the decoder refused is still a
         * message it refused, counted as every such message is. */
        worker *stale = rc == KM_OK && !batch ? km_feed_find_worker(feed, id) : NULL;
        if (stale)
            count_message_refusals(stale, NULL, why);
        return rc;
    }
    w->has_last_receive = true;
    w->last_receive_ns = now_ns;
    w->replay_answered = true;
    count_message_refusals(w, batch, why);
    const char *refusal = replay_item_refusal(w, seq, batch != NULL);
    if (refusal) {
        w->c.refused_replay_items++;
        if (!w->replay_refusal_logged) {
            w->replay_refusal_logged = true;
            feed_log(feed, w,
                     KM_LOG_WARNING
                     "replay %" PRIu64 " from seq %" PRIu64 ": item seq %" PRIu64 " refused (%s)%s",
                     request_id, w->replay_from, seq, refusal,
                     "; further refusals of this request are only counted");
        }
        return KM_OK;
    }
    if (!w->has_expected) {
        /* Bootstrap / resync: the first message the engine still has sets the position. */
        w->c.history_unavailable += seq - (seq < w->replay_from ? seq : w->replay_from);
        w->has_expected = true;
        w->expected = seq;
    }
    if (seq < w->expected) {
        w->c.duplicates++;
        return KM_OK;
    }
    /* The answer is consecutive from its first item, so a skip after that one is not eviction:
     * items were dropped on the way (a ROUTER silently drops what its peer's pipe cannot take).
     * The live buffer fills what it holds of the hole; for the rest, which the engine most
     * likely still holds, the request is asked again from the hole, this one's later items
     * being stale. Each request applies at least its first item or declares the hole lost (it
     * starts later than asked), so this ends. */
    while (seq > w->expected && w->replay_progress) {
        held_message *m = buffer_front(w);
        if (m && m->seq < w->expected) {
            w->c.duplicates++;
            buffer_pop(w);
            continue;
        }
        if (!m || m->seq != w->expected)
            break;
        message_view hv = km_feed_view_of_held(m);
        apply_message(feed, w, m->seq, &hv, false, now_ns);
        buffer_pop(w);
    }
    if (seq < w->expected) {
        w->c.duplicates++;
        return KM_OK;
    }
    if (seq > w->expected && w->replay_progress) {
        w->c.replay_holes++;
        feed_log(feed, w, KM_LOG_INFO "replay %" PRIu64 " skips from seq %" PRIu64 " to %" PRIu64
                 " after its first item: asking again from %" PRIu64, request_id, w->expected,
                 seq, w->expected);
        replay_kind kind = w->replay;
        cancel_replay(feed, w);
        start_replay(feed, w, kind, w->expected, now_ns);
        if (w->replay == REPLAY_NONE)
            drain(feed, w, true, now_ns); /* could not ask: the hole is lost */
        return KM_OK;
    }
    /* The replay starts later than asked (its history was evicted): use the live buffer for what
     * it holds of the hole; the rest is lost. */
    while (seq > w->expected) {
        held_message *m = buffer_front(w);
        if (m && m->seq < w->expected) {
            w->c.duplicates++;
            buffer_pop(w);
            continue;
        }
        if (m && m->seq < seq) {
            if (m->seq > w->expected) {
                declare_lost(feed, w, m->seq - w->expected, now_ns);
                w->expected = m->seq;
            }
            message_view hv = km_feed_view_of_held(m);
            apply_message(feed, w, m->seq, &hv, false, now_ns);
            buffer_pop(w);
            continue;
        }
        feed_log(feed, w, KM_LOG_WARNING
                 "replay %" PRIu64 " resumes at seq %" PRIu64 ", expected %" PRIu64
                 ": history evicted", request_id, seq, w->expected);
        declare_lost(feed, w, seq - w->expected, now_ns);
        w->expected = seq;
    }
    message_view v = km_feed_view_of_batch(batch);
    apply_message(feed, w, seq, &v, true, now_ns);
    w->replay_progress = true;
    return KM_OK;
}

int km_feed_replay_end(km_feed *feed, uint32_t id, uint64_t request_id, uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    int rc;
    worker *w = replay_worker(feed, id, request_id, &rc);
    if (!w)
        return rc;
    w->has_last_receive = true;
    w->last_receive_ns = now_ns;
    replay_kind kind = w->replay;
    bool progress = w->replay_progress;
    w->replay = REPLAY_NONE;
    if (kind != REPLAY_GAP && !w->has_expected) {
        held_message *m = buffer_front(w);
        if (w->replay_answered && m) {
            /* Items came and none could be taken (past the live stream, whose socket lags by more
             * than the engine's buffer): the engine had published, so its stream does not start
             * at 0. As after a failed bootstrap, the first live message held sets the position;
             * the refused seqs arrive live. */
            w->c.history_unavailable += m->seq;
            w->expected = m->seq;
        } else {
            /* The engine had published nothing when it answered: its stream starts at 0. */
            w->expected = 0;
        }
        w->has_expected = true;
    }
    /* A gap replay that gave nothing new cannot fill the hole: asking again would loop. */
    drain(feed, w, kind == REPLAY_GAP && !progress, now_ns);
    return KM_OK;
}

int km_feed_replay_failed(km_feed *feed, uint32_t id, uint64_t request_id,
                          km_feed_replay_failure reason, uint64_t now_ns)
{
    if (!feed)
        return KM_ERR_NULL_POINTER;
    int rc;
    worker *w = replay_worker(feed, id, request_id, &rc);
    if (!w)
        return rc;
    feed_log(feed, w, KM_LOG_WARNING "replay %" PRIu64 " failed (%s)", request_id,
             reason == KM_FEED_REPLAY_TIMEOUT ? "timeout" : "unreachable");
    abandon_replay(feed, w, false, now_ns);
    return KM_OK;
}

/* ---- inspection ------------------------------------------------------------------------------ */

int km_feed_get_worker_info(const km_feed *feed, uint32_t id, km_feed_worker_info *out)
{
    if (!feed || !out)
        return KM_ERR_NULL_POINTER;
    const worker *w = km_feed_find_worker(feed, id);
    if (!w)
        return KM_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->worker = w->id;
    memcpy(out->name, w->name, sizeof out->name);
    out->state = worker_state(w);
    out->has_replay = w->has_replay;
    out->replay_in_flight = w->replay != REPLAY_NONE;
    out->has_expected_seq = w->has_expected;
    out->expected_seq = w->has_expected ? w->expected : 0;
    /* With updates queued, the position as of the last flush. */
    bool queued = feed->group_count > 0 || feed->taken_in_flight;
    out->has_indexed_seq = queued ? w->has_flushed_expected : w->has_expected;
    out->indexed_seq = !out->has_indexed_seq ? 0 : queued ? w->flushed_expected : w->expected;
    out->has_last_receive = w->has_last_receive;
    out->last_receive_ns = w->last_receive_ns;
    out->last_engine_timestamp = w->last_engine_timestamp;
    out->buffered_messages = w->buffer_count;
    out->buffered_bytes = w->buffer_bytes;
    out->map_entries = km_emap_live(&w->map);
    out->counters = w->c;
    out->windows_total = w->windows_total;
    out->windows_open = (uint32_t)w->recovery_open + (uint32_t)w->degraded_open;
    out->windows_kept = w->history_count + out->windows_open;
    out->restored = w->restored;
    out->awaiting_claim = w->awaiting_claim;
    out->config_refused = w->stores_refused_for_config > 0 && w->stores_applied == 0;
    memcpy(out->latest_refusal, w->refusal_example, sizeof out->latest_refusal);
    return KM_OK;
}

int km_feed_get_worker_windows(const km_feed *feed, uint32_t id, km_feed_window *out, uint32_t capacity,
                           uint32_t *n_out)
{
    if (!feed || !n_out || (!out && capacity))
        return KM_ERR_NULL_POINTER;
    const worker *w = km_feed_find_worker(feed, id);
    if (!w)
        return KM_ERR_INVALID_ARGUMENT;
    /* Closed windows oldest first, then the open ones by start time. */
    const km_feed_window *open[2];
    uint32_t n_open = 0;
    if (w->degraded_open)
        open[n_open++] = &w->degraded_window;
    if (w->recovery_open)
        open[n_open++] = &w->recovery;
    if (n_open == 2 && open[1]->start_ns < open[0]->start_ns) {
        const km_feed_window *t = open[0];
        open[0] = open[1];
        open[1] = t;
    }
    uint32_t n = w->history_count + n_open;
    for (uint32_t i = 0; i < n && i < capacity; i++)
        out[i] = i < w->history_count
                     ? w->history[(w->history_head + i) % feed->config.max_windows]
                     : *open[i - w->history_count];
    *n_out = n;
    return KM_OK;
}

int km_feed_get_workers(const km_feed *feed, uint32_t *workers, uint32_t capacity, uint32_t *n_out)
{
    if (!feed || !n_out || (!workers && capacity))
        return KM_ERR_NULL_POINTER;
    for (uint32_t i = 0; i < feed->n_workers && i < capacity; i++)
        workers[i] = feed->workers[i]->id;
    *n_out = feed->n_workers;
    return KM_OK;
}
