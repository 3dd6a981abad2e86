/* SPDX-License-Identifier: Apache-2.0 */
/* Internal to the event feed (src/events/feed.c, feed_updates.c, feed_message.c, feed_snapshot.c):
 * the feed handle and its per-worker state, which the state machine (feed.c) drives, the update
 * queue (feed_updates.c) fills from each applied message, and the snapshot code saves and
 * restores; the copies of live messages held while a replay runs; the functions the files call
 * across. Never included by public headers. */
#ifndef KM_EVENTS_FEED_INTERNAL_H
#define KM_EVENTS_FEED_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "base/array.h"
#include "kvmatch/feed.h"
#include "events/engine_hash_map.h"

/* The km_kv_medium values (GPU, CPU, DISK, OTHER, EXTERNAL); an engine-hash map entry's media is
 * a mask of them. */
#define MEDIUM_COUNT KM_KV_MEDIUM_COUNT

/* ---- copied messages (src/events/feed_message.c) --------------------------------------------- */

/* A live message copied while a replay runs. */
typedef struct held_message {
    uint64_t seq;
    bool malformed;
    double timestamp;
    uint32_t n_events;
    const km_kv_event *events; /* inside the same allocation */
    size_t bytes;
} held_message;

/* A view of a message to apply: a decoded batch or a held copy. */
typedef struct message_view {
    bool malformed;
    double timestamp;
    const km_kv_event *events;
    uint32_t n_events;
} message_view;

static inline message_view km_feed_view_of_batch(const km_kv_batch *batch)
{
    message_view v = {batch == NULL, 0.0, NULL, 0};
    if (batch) {
        v.timestamp = batch->timestamp;
        v.events = batch->events;
        v.n_events = batch->n_events;
    }
    return v;
}

static inline message_view km_feed_view_of_held(const held_message *m)
{
    message_view v = {m->malformed, m->timestamp, m->events, m->n_events};
    return v;
}

/* One allocation holding the message and deep copies of the fields the feed uses; NULL when out of
 * memory. A NULL batch is a malformed message. */
held_message *km_feed_held_copy(uint64_t seq, const km_kv_batch *batch);
/* Content digest of a message, to recognise a late live copy of a message a replay delivered. */
uint64_t km_feed_message_digest(const message_view *v);

/* ---- workers --------------------------------------------------------------------------------- */

typedef enum replay_kind {
    REPLAY_NONE = 0,
    REPLAY_BOOTSTRAP, /* from seq 0 at add time: establishes the stream position */
    REPLAY_GAP,       /* fills [expected, ...): anything the replay cannot give is lost */
    REPLAY_RESYNC,    /* from seq 0 after km_feed_resync_worker: like BOOTSTRAP */
} replay_kind;

/* Lost seq ranges remembered per worker: a live copy of a seq that a replay could no longer give
 * may still be in flight on the SUB socket, and must not pass for a new engine process. */
#define LOST_RANGES 8u

typedef struct dedup_slot {
    uint64_t seq; /* UINT64_MAX = empty */
    uint64_t digest;
} dedup_slot;

/* One followed worker: identity, stream position, replay in flight, live messages held meanwhile,
 * engine-hash map, counters and recovery windows. */
typedef struct worker {
    uint32_t id;
    uint64_t generation; /* unique per add, to match queued groups with this incarnation */
    char name[KM_FEED_NAME_MAX];
    char identity[KM_FEED_NAME_MAX];
    bool has_replay;
    bool restored;       /* state came from km_feed_restore */
    bool awaiting_claim; /* restored, not yet added again */

    bool has_expected;
    uint64_t expected;
    /* expected as of the last flush: while updates are queued, info reports this one, so a reader
     * never sees a seq whose blocks the index does not hold yet. */
    bool has_flushed_expected;
    uint64_t flushed_expected;
    bool has_last_live;
    uint64_t last_live;
    /* last_live came from a snapshot, not from this process's live stream: it still tells an
     * engine restart, but not how far the engine's replay buffer reaches now. */
    bool last_live_restored;
    bool degraded;

    replay_kind replay;
    uint64_t replay_id;
    uint64_t replay_from;
    bool replay_progress; /* the replay applied at least one message */
    bool replay_answered; /* an item of the replay arrived, refused or not */
    bool replay_refusal_logged; /* one log line per request for its refused items */

    held_message **buffer; /* ring of buffer_capacity */
    uint32_t buffer_head, buffer_count, buffer_capacity;
    uint64_t buffer_bytes;

    km_emap map;
    /* The engine announces its offloaded chunks by placeholders (it sent one): its removals from
     * a medium other than the GPU name chunk keys, each removing the chunk's blocks
     * (feed_updates.c, "Announcements"). Kept for the worker's life, and in snapshots. */
    bool placeholder_chunks;
    /* The engine's KV-cache groups (bit per group_idx, seen in GPU stores; the last bit stands
     * for every group from 31 up, which no block ever gets). A block counts (is in the index)
     * while it is held in a medium other than the GPU, or on the GPU by every one of these groups
     * (feed_updates.c, "KV-cache groups"). Forgotten with the map on a restart or resync. */
    uint32_t gpu_groups;
    /* The groups among them whose first GPU store said kind "sliding_window" with a window, or
     * "mamba", and the contiguous blocks each needs before a hit's end (vLLM: max(1,
     * ceil((window - 1) / block_size)); 1 for Mamba, its state at the hit's end). While the engine also has another group, they are its window groups
     * (feed_updates.c, "KV-cache groups"): the index holds their blocks as window keys and scores
     * the worker under a window rule. Forgotten with gpu_groups. */
    uint32_t window_groups;
    uint32_t window_blocks[31];
    /* The window groups of the rule the index scores this worker by (km_index_set_worker_windows,
     * set at each flush from window_groups), and whether the index's rule is unknown (setting it
     * last failed, or the worker is new or restored: another rule may stand under its id). */
    uint32_t index_window_groups;
    bool index_rule_failed;
    dedup_slot *dedup; /* replay_dedup_window slots, allocated with the first replay item */
    uint64_t lost_from[LOST_RANGES], lost_to[LOST_RANGES]; /* recent seq ranges given up as lost */
    uint32_t lost_next, lost_count;

    km_feed_worker_counters c;
    /* BlockStored events applied, and refused for their block size, since the worker was added,
     * its engine last restarted or a resync: all refused means config_refused. */
    uint64_t stores_applied, stores_refused_for_config;
    /* The refusal log line: counts at the last line, when it was written, the latest example. */
    uint64_t refusals_logged[KM_FEED_REFUSAL_COUNT];
    bool has_refusal_log;
    uint64_t refusal_log_ns;
    char refusal_example[KM_FEED_REFUSAL_EXAMPLE_MAX];
    bool has_last_receive;
    uint64_t last_receive_ns;
    double last_engine_timestamp;

    km_feed_window *history; /* ring of closed windows, max_windows */
    uint32_t history_head, history_count;
    uint64_t windows_total;
    bool recovery_open, degraded_open;
    km_feed_window recovery, degraded_window;
} worker;

/* ---- the queue (src/events/feed_updates.c) --------------------------------------------------- */

/* Updates queued for the next km_feed_flush, in groups: one group per applied message or control
 * update of one worker incarnation, each applied all or nothing. */
typedef struct queued_update {
    km_update_kind kind;
    uint32_t worker;
    uint64_t parent;
    uint64_t offset; /* into feed->hashes */
    uint64_t count;
    uint32_t tier; /* km_tier of STORE / SET_TIER */
} queued_update;

typedef struct queued_group {
    uint32_t worker;
    uint64_t generation;
    uint64_t first, count; /* into feed->queue */
    uint64_t events;       /* the message's events: counted applied when the index takes it */
    uint64_t first_key, n_keys; /* into feed->new_keys: the engine hashes it added to the map,
                                 * forgotten again when the index refuses it (unless a later
                                 * group the index took stored them again) */
    int refused; /* km_feed_flush: the index's status when it refused the group alone */
    bool cleared_after; /* km_feed_flush, of a refused group: a later group of its worker that the
                         * index took cleared the worker, so the refusal leaves nothing missing */
} queued_group;

/* A worker's position as of km_feed_flush_take: published as its indexed position once the
 * taken updates are in the index. With it the worker's window rule as of the take, set in the
 * index with the taken updates when it differs from the index's (sync_rule): the groups `windows`
 * and, from window_blocks_at in the taken queue's window_blocks, each one's blocks in ascending
 * group order. */
typedef struct taken_position {
    uint32_t worker;
    uint64_t generation;
    bool has_expected;
    uint64_t expected;
    bool sync_rule;
    uint32_t windows;
    size_t window_blocks_at;
} taken_position;

/* The queue as km_feed_flush_take moved it out, with the arrays it swapped in its place (so the
 * two sets alternate and a flush allocates nothing once they have grown). */
typedef struct taken_queue {
    queued_update *queue;
    size_t queue_count, queue_capacity;
    queued_group *groups;
    size_t group_count, group_capacity;
    uint64_t *hashes;
    size_t hash_count, hash_capacity;
    uint64_t *new_keys;
    size_t new_key_count, new_key_capacity;
    km_update *scratch; /* the updates km_feed_flush_apply hands the index */
    size_t scratch_capacity;
    taken_position *positions;
    size_t n_positions, positions_capacity;
    uint32_t *window_blocks; /* the rules of the positions that sync one */
    size_t window_block_count, window_block_capacity;
    size_t n_rule_clears; /* rule_clears queued before the take: done with the taken updates */
    int status;             /* km_index_apply's, once applied */
    km_update_stats applied; /* what it reported */
} taken_queue;

struct km_feed {
    km_index *index;
    km_feed_config config;
    char last_error[256];

    worker **workers; /* ascending by id */
    uint32_t n_workers;
    size_t workers_capacity;
    uint64_t next_generation;
    uint64_t next_request_id;

    km_feed_action *actions; /* FIFO */
    size_t actions_head, actions_count, actions_capacity;

    queued_update *queue;
    size_t queue_count, queue_capacity;
    queued_group *groups;
    size_t group_count, group_capacity;
    uint64_t *hashes;
    size_t hash_count, hash_capacity;
    size_t hash_reserved; /* the room the last queue_reserve promised ends here */
    uint64_t *new_keys; /* engine hashes new to their worker's map, by queued group */
    size_t new_key_count, new_key_capacity;
    bool group_open;
    km_update *scratch;
    size_t scratch_capacity;
    /* Removed workers whose window rule the index drops at the next flush, with their updates. */
    uint32_t *rule_clears;
    size_t rule_clear_count, rule_clear_capacity;
    /* Per block of one event: the tier it ends in, and (removals) its chain hash. */
    uint8_t *tier_scratch;
    uint64_t *tier_chains;
    size_t tier_scratch_capacity;
    /* Between km_feed_flush_take and km_feed_flush_finish: updates being applied outside the
     * caller's lock, no longer in the queue and not yet in the index. */
    taken_queue taken;
    bool taken_in_flight;
};

/* Grow the array whose address is array_ptr (a T **) to hold `need` elements (feed.c). */
#define GROW(array, capacity, need) KM_ARRAY_GROW(array, capacity, need, 16)

/* The worker followed under id, or NULL (feed.c). */
worker *km_feed_find_worker(const km_feed *feed, uint32_t id);
/* History was lost (or refused by the index): the worker's index is incomplete (feed.c). */
void km_feed_enter_degraded(km_feed *feed, worker *w, uint64_t now, const char *why);
/* The worker's index is complete again: DEGRADED ends, for the reason `end` (feed.c). */
void km_feed_exit_degraded(const km_feed *feed, worker *w, uint64_t now, km_feed_window_end end);

/* Count a refused or skipped event (or undecodable message) for w; example, when not NULL, is
 * the sentence the next refusal log line quotes (feed.c). */
void km_feed_count_refusal(worker *w, km_feed_refusal reason, uint64_t n, const char *example);

/* A control update (clear / remove worker) queued as a group of its own (feed_updates.c). */
int km_feed_queue_control(km_feed *feed, const worker *w, km_update_kind kind);
/* Give the index every followed worker's window rule, and drop those of removed workers; after
 * the queued updates are applied (feed_updates.c). */
void km_feed_sync_window_rules(km_feed *feed);
/* km_feed_flush_take / _apply / _finish: src/events/feed_flush_internal.h. */

/* Queue the updates of a well-formed message's events as one group (feed_updates.c). */
void km_feed_queue_message(km_feed *feed, worker *w, const message_view *v, uint64_t now);

/* Record a failure in feed->last_error ("KM_ERR_NAME: detail"); returns status. */
int km_feed_fail(km_feed *feed, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A zeroed worker with an empty engine-hash map and room for max_windows closed windows; NULL when
 * out of memory. */
worker *km_feed_worker_new(const km_feed *feed);
/* Free a worker and everything it holds; NULL is a no-op. */
void km_feed_worker_free(worker *w);
/* Every worker's engine-hash map is consistent with its side maps (km_emap_check), and keeps
 * parents exactly when the feed walks offloaded chunks of several blocks. KM_OK, or
 * KM_ERR_INTERNAL with the worker and the first violation in why. For tests. */
int km_feed_check_maps(const km_feed *feed, char *why, size_t why_size);
/* A fresh open window of cause, started at now. */
void km_feed_window_init(km_feed_window *win, km_feed_window_cause cause, uint64_t now,
                         uint64_t from_seq);
/* Open w's recovery window, unless one is open already. */
void km_feed_open_recovery(worker *w, km_feed_window_cause cause, uint64_t now,
                           uint64_t from_seq);

#endif
