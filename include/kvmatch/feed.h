/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed: turns the workers' decoded KV events into placement-index updates, and checks
 * each worker's event stream at the break (docs/EVENTS.md, "The feed").
 *
 * The feed is pure logic: no sockets, no clock, no threads. A transport (km_subscriber, or a test)
 * hands it decoded messages with the local monotonic receive time and executes the actions it asks
 * for (replay requests). In return the feed
 *  - recomputes kvmatch chain hashes from each BlockStored's token_ids (docs/HASHING.md), chaining
 *    from the parent's chain hash found through a per-worker map engine hash -> chain hash, which
 *    also turns BlockRemoved's engine hashes back into chain hashes;
 *  - tracks every worker's seq: a gap asks for a replay and merges it in order with the live
 *    messages that arrive meanwhile; a replay that starts later than asked, or fails, means history
 *    is lost (the worker is DEGRADED); a seq going back means the engine restarted (its blocks are
 *    dropped, the index rebuilds from the new stream);
 *  - queues the resulting index updates; km_feed_flush applies everything queued in one
 *    km_index_apply batch, so a scoring batch run between flushes never sees part of an event
 *    batch, and each worker's updates apply in the order its engine produced them;
 *  - keeps per-worker counters and a bounded history of recovery windows (cause, start and end on
 *    the local monotonic clock). Engine timestamps are reported as sent and never subtracted from
 *    local times.
 *
 * Lifecycle: km_feed_config_init -> adjust -> km_feed_create(index) -> km_feed_add_worker ... ->
 * any number of km_feed_live / km_feed_replay_* / km_feed_next_action / km_feed_flush /
 * km_feed_get_worker_info -> km_feed_destroy. The handle is not thread-safe (km_subscriber
 * serialises it under its lock). The index must outlive the feed; the feed writes to it only in
 * km_feed_flush, and it owns the index worker ids it is given (it clears them when a worker is
 * added or removed).
 *
 * Times: every `now_ns` is the caller's monotonic clock in nanoseconds (km_feed_clock_ns() gives
 * CLOCK_MONOTONIC); it must not go backwards. */
#ifndef KVMATCH_FEED_H
#define KVMATCH_FEED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_feed km_feed;

/* Longest worker name kept (longer names are cut), terminating NUL included. */
#define KM_FEED_NAME_MAX 256u

/* What a DEGRADED worker's blocks count for. */
typedef enum km_feed_degraded_policy {
    /* Keep every block (some may be stale, some missing); the worker is flagged DEGRADED. */
    KM_FEED_DEGRADED_KEEP_FLAGGED = 0,
    /* Drop the worker's blocks from the index each time history is lost; blocks stored afterwards
     * are indexed again as they are observed, so what the index holds is only what was seen. */
    KM_FEED_DEGRADED_DROP = 1,
} km_feed_degraded_policy;

/* Blocks whose extra_keys entry is present although the event has no lora_name: the entry holds a
 * cache salt, multimodal item ids or other keys whose content the decoder does not deliver, so the
 * block's content hash cannot be computed faithfully. */
typedef enum km_feed_extra_keys_policy {
    /* Skip such a block and the rest of its event (counted as unhashable_blocks); its descendants
     * are skipped too. The index never claims a salted or multimodal block it cannot name. */
    KM_FEED_EXTRA_KEYS_SKIP = 0,
    /* Hash it from its tokens (and LoRA) alone, as if the keys were absent: salted blocks then look
     * like unsalted ones, and different images with equal placeholder tokens look equal (one chain:
     * removing either image's blocks removes it for the worker; docs/EVENTS.md). */
    KM_FEED_EXTRA_KEYS_IGNORE = 1,
} km_feed_extra_keys_policy;

/* The most blocks per offloaded chunk km_feed_config.offload_chunk_blocks accepts. */
#define KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS 4096u

typedef struct km_feed_config {
    uint32_t block_size; /* the pool's tokens per block; events with another size are rejected;
                          * default 16 */
    /* The engines' lookahead hashing (vLLM's num_hash_lookahead_tokens with EAGLE / MTP
     * speculative decoding; docs/HASHING.md): each BlockStored must carry this many
     * lookahead_token_ids per block (0: none), else it is refused as lookahead_mismatch.
     * At most KM_HASH_MAX_LOOKAHEAD; default 0. */
    uint32_t hash_lookahead_tokens;
    /* Blocks per chunk of the engines' offloading connector (vLLM's OffloadingConnector: its
     * offloaded block size over block_size), used when an engine announces its offloaded chunks
     * by placeholders (km_kv_event.placeholder): a placeholder names the chunk's last block, and
     * the chunk is that block and the offload_chunk_blocks - 1 blocks before it in its sequence
     * (docs/EVENTS.md, "Placeholder stores"). At most KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS (more:
     * KM_ERR_INVALID_ARGUMENT); 0 is taken as 1; default 1. */
    uint32_t offload_chunk_blocks;
    km_feed_degraded_policy degraded_policy; /* default KM_FEED_DEGRADED_KEEP_FLAGGED */
    km_feed_extra_keys_policy extra_keys_policy; /* default KM_FEED_EXTRA_KEYS_SKIP */
    /* Ask a worker that has a replay endpoint for its whole buffered history (replay from seq 0)
     * as soon as it is added, before trusting the live stream. Default true. */
    bool bootstrap_replay;
    uint32_t max_buffered_messages; /* live messages held per worker while a replay runs; one more
                                     * abandons the replay (history lost); default 10,000 */
    uint64_t max_buffered_bytes;    /* the same bound in bytes of copied events; default 256 MiB */
    uint32_t max_windows;           /* recovery windows kept per worker (oldest dropped first);
                                     * default 64 */
    uint64_t max_queued_hashes;     /* hashes queued for the next flush, all workers together,
                                     * and equally updates; a message whose hashes or events would
                                     * pass it is dropped (its worker becomes DEGRADED); a clear
                                     * names its worker's blocks only while they fit in half of it
                                     * (else the index scans); default 1 << 24 */
    uint32_t replay_dedup_window;   /* recently replayed messages remembered per worker to tell a
                                     * late live duplicate from a restarted engine; default 1024 */
    km_log_fn log;                  /* one line per notable transition; NULL = stderr */
    void *log_user;
    /* Told of each run of blocks a flush had the index store for a worker (a STORE update,
     * hashes as the index keys them), once the index took it, from the thread that flushed and
     * under the locks the flush holds (so it must take none that is held around a flush);
     * hashes are valid during the call only. NULL: nobody is told. */
    void (*on_stored)(void *user, uint32_t worker, const uint64_t *hashes, size_t n);
    void *on_stored_user;
} km_feed_config;

void km_feed_config_init(km_feed_config *cfg);

/* cfg NULL = defaults. Errors: KM_ERR_NULL_POINTER (index, out), KM_ERR_INVALID_ARGUMENT (a limit
 * of 0), KM_ERR_BLOCK_SIZE, KM_ERR_OUT_OF_MEMORY. */
int km_feed_create(km_index *index, const km_feed_config *cfg, km_feed **out);
void km_feed_destroy(km_feed *feed); /* NULL is a no-op; queued updates are discarded */

/* Detail of the last failed call ("" when none). Valid until the next call on the handle. */
const char *km_feed_last_error(const km_feed *feed);

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t km_feed_clock_ns(void);

/* ---- workers --------------------------------------------------------------------------------- */

typedef struct km_feed_worker_config {
    uint32_t worker;  /* index worker id: 0 .. the index's max_workers - 1 */
    const char *name; /* for logs and info, e.g. the endpoint; NULL = "" */
    bool has_replay;  /* the worker has a replay endpoint the transport can ask */
} km_feed_worker_config;

/* Start following a worker. Queues a CLEAR_WORKER (the id starts empty), opens a STARTUP window,
 * and, when bootstrap_replay and has_replay, queues a replay request from seq 0.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_INVALID_ARGUMENT (already added),
 * KM_ERR_OUT_OF_MEMORY. */
int km_feed_add_worker(km_feed *feed, const km_feed_worker_config *cfg, uint64_t now_ns);
/* km_feed_add_worker with the producer's identity, kept in snapshots (km_feed_save), e.g.
 * "endpoint replay_endpoint" (km_subscriber's form); NULL = cfg->name. A worker restored by
 * km_feed_restore is resumed only when added again with the same id and identity (see
 * km_feed_restore); km_feed_add_worker uses the name as the identity. */
int km_feed_add_worker_identity(km_feed *feed, const km_feed_worker_config *cfg,
                                const char *identity, uint64_t now_ns);
/* Stop following a worker: its state and history are freed and a REMOVE_WORKER is queued (the
 * index drops its blocks and counters at the next flush). A replay in flight is cancelled.
 * Errors: KM_ERR_INVALID_ARGUMENT (not added). */
int km_feed_remove_worker(km_feed *feed, uint32_t worker, uint64_t now_ns);
/* Full resync: drop the worker's blocks and map, and rebuild from its replay buffer (replay from
 * seq 0) or, without a replay endpoint, from the next live message. Ends DEGRADED.
 * Errors: KM_ERR_INVALID_ARGUMENT (not added). */
int km_feed_resync_worker(km_feed *feed, uint32_t worker, uint64_t now_ns);

/* ---- inputs ---------------------------------------------------------------------------------- */

/* A message from the worker's live (SUB) stream. batch NULL: the frames held a readable seq but
 * the payload was rejected by the decoder; the message is counted as malformed, and its seq is
 * consumed only when it is the one right after the last live seq (before any live message: the
 * next seq to apply); any other seq read from it changes nothing else. seq KM_KV_REPLAY_END_SEQ
 * is never a message's: such a message, decodable or not, is counted as malformed and changes
 * nothing else. The batch is copied when it must wait (replay in progress); the caller may reuse its
 * memory when the call returns. Running out of memory is not an error of the call: the affected
 * message is handled as lost or dropped (counted, worker DEGRADED) and the state stays consistent.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (worker not added). */
int km_feed_live(km_feed *feed, uint32_t worker, uint64_t seq, const km_kv_batch *batch,
                 uint64_t now_ns);
/* km_feed_live with batch NULL, saying why the message did not decode: `why` (the decoder's
 * km_kv_decoder_last_error, naming the frame, event, field or limit; NULL = not known) becomes
 * the worker's latest refusal (km_feed_worker_info.latest_refusal) and goes into its refusal log
 * line. */
int km_feed_live_undecodable(km_feed *feed, uint32_t worker, uint64_t seq, const char *why,
                             uint64_t now_ns);
/* A message from the worker that had no readable seq (wrong frame count, a seq frame of the wrong
 * size), received on `source`'s socket: counted as malformed (and, from the live socket, as a
 * live message: counters.messages), nothing else changes. `why` as for
 * km_feed_live_undecodable. */
int km_feed_malformed(km_feed *feed, uint32_t worker, km_kv_source source, const char *why,
                      uint64_t now_ns);

/* Replay answers, tagged with the request id of the km_feed_action they answer. Answers to any
 * other id (a cancelled or superseded request) are counted and ignored. batch NULL: a malformed
 * item with a readable seq (counted as malformed; the seq is consumed only when it is the next
 * seq to apply). An item whose seq the request cannot return (below its start, 2^64-1, a skip
 * past the newest live seq) is refused: counted (refused_replay_items), logged once per request,
 * nothing else changes (docs/EVENTS.md, "Replay items outside the request"). An item past the
 * next seq after the request's first item lost the items between on the way: what the held live
 * messages lack of them is asked for again from the first missing seq (counters.replay_holes; a
 * REPLAY_CANCEL and a REPLAY_REQUEST action), never counted lost (docs/EVENTS.md, "Gaps"). */
int km_feed_replay_item(km_feed *feed, uint32_t worker, uint64_t request_id, uint64_t seq,
                        const km_kv_batch *batch, uint64_t now_ns);
/* km_feed_replay_item with batch NULL, saying why the item did not decode (as
 * km_feed_live_undecodable). */
int km_feed_replay_item_undecodable(km_feed *feed, uint32_t worker, uint64_t request_id,
                                    uint64_t seq, const char *why, uint64_t now_ns);
int km_feed_replay_end(km_feed *feed, uint32_t worker, uint64_t request_id, uint64_t now_ns);

typedef enum km_feed_replay_failure {
    KM_FEED_REPLAY_TIMEOUT = 1,     /* no answer within the transport's deadline */
    KM_FEED_REPLAY_UNREACHABLE = 2, /* the request could not be sent */
} km_feed_replay_failure;

/* The replay for request_id will not complete. The missing history is lost (DEGRADED), except
 * for a bootstrap or resync replay, where the stream simply starts at the next live message. */
int km_feed_replay_failed(km_feed *feed, uint32_t worker, uint64_t request_id,
                          km_feed_replay_failure reason, uint64_t now_ns);

/* ---- actions for the transport --------------------------------------------------------------- */

typedef enum km_feed_action_kind {
    /* Send one replay request for seqs >= start_seq to the worker's replay endpoint. A worker has
     * at most one replay in flight: a new request supersedes the previous one, whose answers the
     * transport must not mix in (km_subscriber opens a fresh socket). */
    KM_FEED_ACTION_REPLAY_REQUEST = 1,
    /* Stop waiting for request_id (answers to it will be ignored; the transport may drop them). */
    KM_FEED_ACTION_REPLAY_CANCEL = 2,
} km_feed_action_kind;

typedef struct km_feed_action {
    km_feed_action_kind kind;
    uint32_t worker;
    uint64_t request_id; /* unique per feed, from 1 */
    uint64_t start_seq;  /* REPLAY_REQUEST only */
} km_feed_action;

/* Pop the oldest pending action: 1 when *out was filled, 0 when none is pending. */
int km_feed_next_action(km_feed *feed, km_feed_action *out);

/* ---- applying -------------------------------------------------------------------------------- */

typedef struct km_feed_flush_stats {
    uint64_t updates;          /* km_update entries applied */
    uint64_t groups;           /* messages (and control steps) applied */
    uint64_t groups_failed;    /* messages the index refused (memory cap / out of memory) */
    km_update_stats index;     /* what km_index_apply reported, summed */
} km_feed_flush_stats;

/* Apply every queued update to the index in one km_index_apply batch (call it between scoring
 * batches). When the index refuses the batch (KM_ERR_MEMORY_CAP, KM_ERR_OUT_OF_MEMORY), it is
 * applied message by message instead: each message's updates still apply all or nothing, a refused
 * message is dropped (its removals and clears still applied, as they never allocate) and its
 * worker becomes DEGRADED unless a later message of the worker applied in this flush cleared it,
 * and the first error is returned after the queue has been consumed. Any other index error is
 * returned with the queue kept. stats may be NULL. */
int km_feed_flush(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats);
/* Hashes and updates waiting for the next flush. */
void km_feed_pending(const km_feed *feed, uint64_t *updates, uint64_t *hashes);

/* ---- inspection ------------------------------------------------------------------------------ */

/* The three enums below are X-macro lists, X(NAME, value, "name"): the list generates the enum,
 * and the km_feed_*_name functions the names. */

/* A worker's state.
 *   SYNCING   no stream position yet (waiting for the first message, or a bootstrap / resync
 *             replay is running)
 *   LIVE      every message since the stream position was applied in order
 *   GAP       a replay is filling a gap; the index lags the worker
 *   DEGRADED  history was lost: the worker's index is incomplete until a restart, an
 *             AllBlocksCleared or a resync */
#define KM_FEED_STATE_LIST(X)                \
    X(KM_FEED_STATE_SYNCING, 0, "SYNCING")   \
    X(KM_FEED_STATE_LIVE, 1, "LIVE")         \
    X(KM_FEED_STATE_GAP, 2, "GAP")           \
    X(KM_FEED_STATE_DEGRADED, 3, "DEGRADED")

/* Why a recovery window opened, and until when it lasts.
 *   startup   worker added, until its stream position and history are known
 *   gap       a seq gap, until a replay filled it or it was found lost
 *   restart   seq went back (new engine process), until its stream is applied
 *   resync    km_feed_resync_worker, until the rebuild finished
 *   degraded  history lost, until a restart, AllBlocksCleared or resync
 *   resume    restart of kvmatch: restored from a snapshot, until the stream from the saved
 *             seq + 1 is applied (or found lost) */
#define KM_FEED_WINDOW_CAUSE_LIST(X)          \
    X(KM_FEED_WINDOW_STARTUP, 1, "startup")   \
    X(KM_FEED_WINDOW_GAP, 2, "gap")           \
    X(KM_FEED_WINDOW_RESTART, 3, "restart")   \
    X(KM_FEED_WINDOW_RESYNC, 4, "resync")     \
    X(KM_FEED_WINDOW_DEGRADED, 5, "degraded") \
    X(KM_FEED_WINDOW_RESUME, 6, "resume")

/* How a window ended.
 *   open       still open
 *   recovered  the history is complete again
 *   lost       recovery finished but history was lost (a DEGRADED window opened)
 *   restart    ended by an engine restart
 *   cleared    DEGRADED ended by AllBlocksCleared: the engine dropped everything
 *   resync     ended by km_feed_resync_worker */
#define KM_FEED_WINDOW_END_LIST(X)           \
    X(KM_FEED_END_OPEN, 0, "open")           \
    X(KM_FEED_END_RECOVERED, 1, "recovered") \
    X(KM_FEED_END_LOST, 2, "lost")           \
    X(KM_FEED_END_RESTART, 3, "restart")     \
    X(KM_FEED_END_CLEARED, 4, "cleared")     \
    X(KM_FEED_END_RESYNC, 5, "resync")

/* Why an event was refused (kept out of the index) or skipped, counted per worker and reason.
 *   block_size_mismatch  BlockStored whose block_size is not the pool's (or outside 1..2^32-1):
 *                        the engine runs with another block size, a configuration error
 *   token_count          BlockStored whose token_ids are not block_size per block hash
 *   unknown_parent       BlockStored whose parent's engine hash the worker's map does not hold
 *                        (expected after joining mid-stream; its blocks are skipped)
 *   unknown_type         an event type this decoder does not know (skipped)
 *   undecodable          a message whose frames or payload did not decode (counted per message)
 *   unknown_medium       BlockStored or BlockRemoved naming a medium no tier is known for: still
 *                        applied, at the disk tier (the slowest), and counted so an operator sees it
 *   invalid_event        any other inconsistent event (extra_keys not one entry per block, a NUL
 *                        byte inside a string field)
 *   lookahead_mismatch   BlockStored whose lookahead tokens per block are not the pool's
 *                        hash_lookahead_tokens: the engine's speculative-decoding setting differs
 *                        from the pool's, a configuration error like block_size_mismatch
 *   partial_block        BlockStored of a KV-cache group that kvmatch cannot place block by block:
 *                        one partial block (vLLM's cache_partial_block for hybrid models, Mamba
 *                        align mode: one block hash, group_idx set, fewer tokens than
 *                        block_size), or the hashes of only some of the blocks its token_ids
 *                        cover (km_kv_event.sparse_blocks: a group that keeps only some blocks);
 *                        skipped; not a configuration error
 *   unplaced_placeholder a placeholder store's engine hash (km_kv_event.placeholder) that the
 *                        worker's map does not hold (its full store never seen, or the block
 *                        already gone from every medium), or a placeholder store on an engine with
 *                        more than one KV-cache group: skipped, counted per engine hash; the index
 *                        holds less than the engine, never more; not a configuration error */
#define KM_FEED_REFUSAL_LIST(X)                                 \
    X(KM_FEED_REFUSED_BLOCK_SIZE, 0, "block_size_mismatch")     \
    X(KM_FEED_REFUSED_TOKEN_COUNT, 1, "token_count")            \
    X(KM_FEED_REFUSED_UNKNOWN_PARENT, 2, "unknown_parent")      \
    X(KM_FEED_REFUSED_UNKNOWN_TYPE, 3, "unknown_type")          \
    X(KM_FEED_REFUSED_UNDECODABLE, 4, "undecodable")            \
    X(KM_FEED_REFUSED_UNKNOWN_MEDIUM, 5, "unknown_medium")      \
    X(KM_FEED_REFUSED_INVALID_EVENT, 6, "invalid_event")        \
    X(KM_FEED_REFUSED_LOOKAHEAD, 7, "lookahead_mismatch")       \
    X(KM_FEED_REFUSED_PARTIAL_BLOCK, 8, "partial_block")        \
    X(KM_FEED_REFUSED_UNPLACED_PLACEHOLDER, 9, "unplaced_placeholder")
#define KM_FEED_REFUSAL_COUNT 10u
/* Bytes of km_feed_worker_info.latest_refusal, its terminating NUL included (a longer sentence
 * is cut). */
#define KM_FEED_REFUSAL_EXAMPLE_MAX 384u

#define KM_FEED_ENUM_ENTRY(name, value, text) name = value,
typedef enum km_feed_state { KM_FEED_STATE_LIST(KM_FEED_ENUM_ENTRY) } km_feed_state;
typedef enum km_feed_window_cause {
    KM_FEED_WINDOW_CAUSE_LIST(KM_FEED_ENUM_ENTRY)
} km_feed_window_cause;
typedef enum km_feed_window_end { KM_FEED_WINDOW_END_LIST(KM_FEED_ENUM_ENTRY) } km_feed_window_end;
typedef enum km_feed_refusal { KM_FEED_REFUSAL_LIST(KM_FEED_ENUM_ENTRY) } km_feed_refusal;
#undef KM_FEED_ENUM_ENTRY

/* One recovery window. Times are the local monotonic clock (the now_ns of the calls). */
typedef struct km_feed_window {
    km_feed_window_cause cause;
    km_feed_window_end end;
    uint64_t start_ns;
    uint64_t end_ns;      /* 0 while open */
    uint64_t duration_ns; /* end_ns - start_ns; 0 while open */
    uint64_t from_seq;    /* GAP: first missing seq; RESTART: the seq that revealed it; else 0 */
    uint64_t replay_requests; /* replay requests sent during the window */
    uint64_t replayed;    /* messages applied from replays during the window */
    uint64_t lost;        /* seqs skipped without being applied during the window */
} km_feed_window;

/* Counters over the worker's life in this feed (since km_feed_add_worker). */
typedef struct km_feed_worker_counters {
    uint64_t messages;           /* live messages received (malformed included) */
    uint64_t events;             /* events applied: counted when the index takes their updates
                                  * (km_feed_flush); a refused message's are refused_events */
    uint64_t blocks_stored;      /* blocks of applied BlockStored events, hashed and queued */
    uint64_t blocks_removed;     /* blocks whose last medium was removed (queued REMOVE) */
    uint64_t stored_by_medium[KM_KV_MEDIUM_COUNT];  /* blocks of applied BlockStored events by
                                                     * km_kv_medium */
    uint64_t removed_by_medium[KM_KV_MEDIUM_COUNT]; /* blocks of applied BlockRemoved events by
                                                     * km_kv_medium */
    uint64_t clears;             /* AllBlocksCleared events applied */
    uint64_t gaps;               /* seq gaps detected */
    uint64_t replay_requests;    /* replay requests issued */
    uint64_t replay_failures;    /* replays that timed out, could not be sent, or were abandoned */
    uint64_t replayed;           /* messages applied from replays */
    uint64_t duplicates;         /* messages skipped because their seq was already applied */
    uint64_t lost;               /* seqs skipped without being applied (history lost) */
    uint64_t late_lost;          /* live copies of seqs already given up as lost, arriving late:
                                  * skipped (the worker stays DEGRADED) */
    uint64_t history_unavailable; /* seqs before the first one this feed could get at startup or
                                  * resync (the engine's history before we joined) */
    uint64_t restarts;           /* engine restarts detected (seq went back) */
    uint64_t malformed;          /* messages the decoder rejected */
    uint64_t rejected_events;    /* events the decoder rejected inside accepted messages */
    uint64_t unknown_events;     /* events of unknown types, skipped */
    uint64_t unknown_parent_blocks; /* blocks skipped: parent's engine hash not in the map */
    uint64_t unhashable_blocks;  /* blocks skipped by KM_FEED_EXTRA_KEYS_SKIP (and descendants) */
    uint64_t block_size_mismatch; /* BlockStored events rejected: block_size != the pool's */
    uint64_t unknown_removes;    /* removed engine hashes not in the map */
    uint64_t buffer_overflows;   /* replays abandoned because the live buffer was full */
    uint64_t stale_replay_items; /* replay answers to a cancelled or superseded request (one
                                  * that did not decode counts in malformed and refused too) */
    uint64_t replay_holes;       /* replay answers that skipped ahead after their first item
                                  * (items dropped on the way), asked again from the hole */
    uint64_t refused_replay_items; /* replay answers whose seq the request cannot return (below
                                  * its start, 2^64-1, skipping past the newest live seq) or, for
                                  * a rejected payload, is not the next seq to apply: skipped */
    uint64_t dropped_messages;   /* messages whose updates were dropped (queue full, index refused) */
    /* Events refused or skipped, by km_feed_refusal (undecodable: messages). Counted as received:
     * a message seen live and again in a replay counts twice. */
    uint64_t refused[KM_FEED_REFUSAL_COUNT];
    uint64_t refused_messages;   /* of which the index refused (km_feed_flush): the worker turns
                                  * DEGRADED (unless a later message applied cleared it) and the
                                  * map forgets the engine hashes they added that no later applied
                                  * message stored again */
    uint64_t refused_events;     /* events of the refused messages (never counted in events) */
    uint64_t memory_cap_refusals; /* refused messages whose batch hit the index's memory cap
                                  * (KM_ERR_MEMORY_CAP; the rest: out of memory) */
} km_feed_worker_counters;

typedef struct km_feed_worker_info {
    uint32_t worker;
    char name[KM_FEED_NAME_MAX];
    km_feed_state state;
    bool has_replay;
    bool replay_in_flight;
    bool has_expected_seq;
    uint64_t expected_seq;       /* next seq to apply */
    /* The next seq to apply as of the last km_feed_flush while updates are queued (else
     * expected_seq): the index holds every message before it, so a reader comparing it with the
     * index never sees a seq ahead of its blocks. */
    bool has_indexed_seq;
    uint64_t indexed_seq;
    bool has_last_receive;
    uint64_t last_receive_ns;    /* local monotonic time of the last message (live or replay) */
    double last_engine_timestamp; /* ts of the last applied batch, as the engine sent it (another
                                   * host's wall clock: never compare it with local times) */
    uint32_t buffered_messages;  /* live messages waiting for a replay to finish */
    uint64_t buffered_bytes;
    uint64_t map_entries;        /* engine hashes known */
    km_feed_worker_counters counters;
    uint64_t windows_total;      /* windows ever opened */
    uint32_t windows_kept;       /* in the history now (at most max_windows) */
    uint32_t windows_open;
    bool restored;               /* state came from a snapshot (km_feed_restore) */
    bool awaiting_claim;         /* restored, not yet added again by the transport */
    /* The engine's configuration does not fit the pool: since the worker was added (or its engine
     * last restarted, or a resync) at least one BlockStored was refused for its block size or its
     * lookahead tokens and none was applied. Such a worker would read LIVE with no blocks forever; readiness does not
     * count it (docs/EVENTS.md, "Refused events"). */
    bool config_refused;
    /* The latest refusal in a sentence ("BlockStored with block_size 32, the pool's is 16"; for an
     * undecodable message, why the decoder refused it: "a message that did not decode:
     * KM_ERR_TOO_LARGE: batch has 70000 events, limit max_events_per_batch = 65536"); "" when
     * none. */
    char latest_refusal[KM_FEED_REFUSAL_EXAMPLE_MAX];
} km_feed_worker_info;

/* Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (not added). */
int km_feed_get_worker_info(const km_feed *feed, uint32_t worker, km_feed_worker_info *out);
/* The kept windows, oldest first; *n_out gets the number kept even when capacity is short. */
int km_feed_get_worker_windows(const km_feed *feed, uint32_t worker, km_feed_window *out,
                           uint32_t capacity, uint32_t *n_out);
/* Worker ids currently followed, ascending; *n_out gets the full count. */
int km_feed_get_workers(const km_feed *feed, uint32_t *workers, uint32_t capacity, uint32_t *n_out);

/* ---- snapshots (restart of kvmatch) ---------------------------------------------------------- */

/* Feed-state format version written by km_feed_save / km_feed_export_state. 6: chain hashes
 * under the LoRA / salt seed rules of docs/HASHING.md ("Seeds"), media masks of
 * KM_KV_MEDIUM_COUNT bits, the KV-cache groups holding each block on the GPU with the copies
 * beyond the first a group holds, each worker's sliding-window groups with their window in
 * blocks, whether the worker announces offloaded chunks by placeholders, each block's parent
 * engine hash where the pool keeps parents (offload_chunk_blocks above 1) and the announcements
 * beyond one holding a block in a medium other than the GPU. Any other version is
 * refused (KM_ERR_INCOMPATIBLE): version 1 holds chain hashes under other rules, version 2 lacks
 * the groups, without which a hybrid model's blocks would count where a group lacks them, version
 * 3 the window groups, without which the index would score such a worker without its window rule,
 * version 4 the copies, without which a block cached twice would leave the index with its first
 * copy's removal, version 5 the parents and announcements, without which a block in two offloaded
 * chunks would leave the tier with the first chunk's removal and a placeholder chunk's earlier
 * blocks could not be found. */
#define KM_FEED_STATE_VERSION 6u

/* Serialise what a restart needs, per worker: id, name, identity, replay flag, stream position
 * (next seq to apply, last live seq), DEGRADED flag, the engine's KV-cache groups and the
 * engine-hash -> chain-hash (+ medium mask and groups) map. Queued (unflushed) updates are NOT
 * part of it: call it right after km_feed_flush (as km_feed_save does) so that the state matches
 * the index. Counters and windows are not kept.
 * *out is malloc'd (free()). Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (updates are
 * queued), KM_ERR_OUT_OF_MEMORY. */
int km_feed_export_state(const km_feed *feed, void **out, size_t *size_out);

/* Install a state from km_feed_export_state into a feed that follows no worker yet. The section is
 * validated in full before anything changes. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT
 * (the feed already follows workers), KM_ERR_CORRUPT (truncated, bad magic, out-of-range or
 * inconsistent fields), KM_ERR_INCOMPATIBLE (another format version, another block size, a worker
 * id outside the index), KM_ERR_OUT_OF_MEMORY. */
int km_feed_import_state(km_feed *feed, const void *data, size_t size, uint64_t now_ns);

/* A consistent snapshot at a flush boundary: km_feed_flush, then km_index_save(index, path, feed
 * state as the caller section): atomic (temporary file, fsync, rename). Errors: those of
 * km_feed_flush, km_feed_export_state and km_index_save (KM_ERR_IO). */
int km_feed_save(km_feed *feed, const char *path, uint64_t now_ns);

/* Restart of kvmatch: load the index and feed state saved by km_feed_save into a fresh feed (no
 * worker followed; its index's content is replaced). Nothing is installed unless the whole file
 * is valid, the feed section included (km_index_load_checked): on any error the feed and the index
 * are exactly as they were, km_feed_last_error says why, and workers added afterwards bootstrap
 * normally. Errors: KM_ERR_IO (missing, unreadable), KM_ERR_CORRUPT,
 * KM_ERR_INCOMPATIBLE, KM_ERR_INVALID_ARGUMENT (workers already followed), KM_ERR_MEMORY_CAP,
 * KM_ERR_OUT_OF_MEMORY.
 *
 * Each restored worker waits to be claimed: km_feed_add_worker with the same id and identity
 * resumes it instead of starting afresh. It then wants seq last + 1 (a RESUME recovery window
 * opens, the state reads GAP until the stream is confirmed): with a replay endpoint a replay from
 * last + 1 is requested at once; a replay that cannot cover the gap makes it DEGRADED with the
 * missing seqs counted as lost; without one, the first live message settles it (a later seq: the
 * skipped ones are lost). A seq at or below the last one seen means a different engine process
 * behind the same endpoint (vLLM has no producer epoch): handled as an engine restart (the
 * worker's blocks are dropped). A worker added with another identity starts afresh (its restored
 * blocks are dropped first). Restored workers never claimed stay in the index until removed. */
int km_feed_restore(km_feed *feed, const char *path, uint64_t now_ns);

/* The names in the lists above ("SYNCING", "startup", "open", ...); "unknown" outside them. */
const char *km_feed_state_name(km_feed_state state);
const char *km_feed_window_cause_name(km_feed_window_cause cause);
const char *km_feed_window_end_name(km_feed_window_end end);
/* "block_size_mismatch", "token_count", ... (KM_FEED_REFUSAL_LIST); "unknown" outside it. */
const char *km_feed_refusal_name(km_feed_refusal reason);

#ifdef __cplusplus
}
#endif
#endif
