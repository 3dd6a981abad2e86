/* SPDX-License-Identifier: Apache-2.0 */
/* The KV-event subscriber: the ZMQ transport that feeds a km_feed from the workers' own event
 * streams (vLLM / SGLang ZmqEventPublisher; docs/EVENTS.md, "The subscriber").
 *
 * One I/O thread owns every socket: per worker a SUB socket (all topics) connected to the worker's
 * PUB endpoint and, when the worker has one, a DEALER connected to its replay (ROUTER) endpoint.
 * The thread decodes each message with a km_kv_decoder and hands it to the feed under the
 * subscriber's lock, sends the replay requests the feed asks for ([empty, start_seq as 8 bytes
 * big-endian]) and fails a replay that gets no answer within replay_timeout_ms. Malformed frames
 * and payloads are counted and skipped: bad input never stops the thread.
 *
 * The index is written only by km_subscriber_flush, called by the thread that also scores
 * (between scoring batches): it takes the lock and applies every queued update in one
 * km_index_apply batch, so a scoring batch never sees half an event batch. The subscriber never
 * touches the index otherwise; the caller keeps serialising index calls as index.h requires.
 *
 * Lifecycle: km_subscriber_config_init -> adjust -> km_subscriber_create(index) (starts the
 * thread) -> km_subscriber_add_worker / add_engine / remove_worker at any time, from any thread ->
 * km_subscriber_flush + km_index_match_batch in the scoring loop; km_subscriber_get_worker_info
 * etc. from any thread -> km_subscriber_destroy (prompt: stops the thread, closes every socket).
 * The index must outlive the subscriber. */
#ifndef KVMATCH_SUBSCRIBER_H
#define KVMATCH_SUBSCRIBER_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"
#include "kvmatch/feed.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_subscriber km_subscriber;

/* Longest endpoint accepted, terminating NUL included (ZMQ endpoints are short). */
#define KM_SUBSCRIBER_ENDPOINT_MAX 256u

typedef struct km_subscriber_config {
    km_feed_config feed;          /* the feed the subscriber owns (block size, policies, limits) */
    km_kv_decoder_config decoder; /* wire limits; max_payload_bytes also caps ZMQ_MAXMSGSIZE */
    uint32_t replay_timeout_ms;   /* a replay with no answer for this long fails; default 5000 */
    int32_t receive_hwm;          /* ZMQ_RCVHWM of each SUB and replay DEALER socket (messages
                                   * libzmq takes off the wire while the I/O thread is busy; a
                                   * replay ROUTER drops what its peer cannot take); default
                                   * 100,000 (the publisher's PUB default, 10x its replay
                                   * buffer) */
    uint32_t max_messages_per_wakeup; /* taken from one socket before the others get a turn;
                                       * default 256 */
    km_log_fn log;                /* transport lines; NULL = stderr. May be called with the
                                   * handle's lock held: it must not call into this
                                   * subscriber */
    void *log_user;
    /* Restart of kvmatch (docs/EVENTS.md, "Restart of kvmatch"). Periodic snapshots: when
     * snapshot_path is set and snapshot_interval_ms > 0, km_subscriber_flush writes one (via
     * km_feed_save, atomic) once the interval has passed since the last, after applying too what
     * was queued while the index applied (under the lock, so the snapshot has nothing left to
     * apply and holds every message received before it). They are taken there, on
     * the scoring thread, because only there is the index both consistent with the feed and not
     * being read (the I/O thread never touches the index). A failed snapshot is logged and counted
     * (stats.snapshot_failures), never fatal. Default NULL / 0 (none). */
    const char *snapshot_path;
    uint32_t snapshot_interval_ms;
    /* Load this snapshot at create, before any socket exists (km_feed_restore). Workers added
     * afterwards with the same id and endpoints resume from their saved seq + 1. A failure (missing,
     * corrupt, truncated, other version or block size) is logged at error level and recorded in
     * stats.restore_status and restore_error; the subscriber starts empty, and the file is moved
     * aside before any snapshot would overwrite it (stats.unrestorable_kept_as). NULL = none. */
    const char *restore_path;
    /* Periodic snapshots written by a forked child process from a copy-on-write image of the
     * index and feed, so the thread that flushes pauses only for the fork (which copies page tables,
     * not the data) instead of the whole write. The child is reaped by later flushes,
     * km_subscriber_get_stats, km_subscriber_save (which waits for it) and destroy; its result is
     * counted in stats.snapshots / snapshot_failures when reaped. If fork fails the snapshot is
     * written in place. Default false. */
    bool snapshot_background;
    /* Called on the I/O thread after a wake-up that received messages (their updates are queued):
     * a service wakes its flushing thread so events reach the index within microseconds instead of
     * at its next tick. Must be quick and thread-safe. NULL = none. */
    void (*on_received)(void *user);
    void *on_received_user;
} km_subscriber_config;

void km_subscriber_config_init(km_subscriber_config *cfg);

/* Starts the I/O thread. cfg NULL = defaults. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT,
 * KM_ERR_BLOCK_SIZE (from the feed or decoder config), KM_ERR_OUT_OF_MEMORY, KM_ERR_IO (ZMQ or
 * the thread could not start). */
int km_subscriber_create(km_index *index, const km_subscriber_config *cfg, km_subscriber **out);
/* Stops the thread and closes every socket; queued updates not yet flushed are discarded.
 * NULL is a no-op. */
void km_subscriber_destroy(km_subscriber *sub);

/* Detail of the last failed call on this handle, from any thread ("" when none). The returned
 * string is the calling thread's own copy: it stays valid, unchanged, until that thread calls
 * km_subscriber_last_error again. */
const char *km_subscriber_last_error(const km_subscriber *sub);

/* ---- workers ---------------------------------------------------------------------------------- */

typedef struct km_subscriber_worker {
    uint32_t worker;             /* index worker id */
    const char *name;            /* for logs and info; NULL = the endpoint */
    const char *endpoint;        /* the worker's PUB endpoint, e.g. "tcp://10.0.0.5:5557" */
    const char *replay_endpoint; /* its replay endpoint, e.g. "tcp://10.0.0.5:5558"; NULL = none */
} km_subscriber_worker;

/* Connect to a worker and start following it (km_feed_add_worker: with a replay endpoint and
 * feed.bootstrap_replay, its buffered history is asked for at once). Returns when the sockets
 * exist; connecting itself is asynchronous (ZMQ retries until the worker is up).
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (already followed, bad endpoint),
 * KM_ERR_WORKER_RANGE, KM_ERR_TOO_LARGE (endpoint over KM_SUBSCRIBER_ENDPOINT_MAX),
 * KM_ERR_OUT_OF_MEMORY, KM_ERR_IO. */
int km_subscriber_add_worker(km_subscriber *sub, const km_subscriber_worker *worker);
/* Whether km_subscriber_add_worker would accept worker's endpoints: their lengths, and a socket
 * connected to each and closed at once. Follows nothing and ignores whether the id is followed.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_TOO_LARGE, KM_ERR_INVALID_ARGUMENT (bad endpoint), KM_ERR_IO;
 * km_subscriber_last_error says why. */
int km_subscriber_check_worker(km_subscriber *sub, const km_subscriber_worker *worker);
/* An engine with data_parallel_size ranks: rank r is worker rank0->worker + r, on the endpoints of
 * km_endpoint_for_rank (port + r), named "<name>/dp<r>". All or nothing. */
int km_subscriber_add_engine(km_subscriber *sub, const km_subscriber_worker *rank0,
                             uint32_t data_parallel_size);
/* Disconnect and stop following; the worker's blocks leave the index at the next flush. Also
 * removes a worker restored from a snapshot (restore_path) that was never added again. */
int km_subscriber_remove_worker(km_subscriber *sub, uint32_t worker);
/* km_feed_resync_worker through the I/O thread. */
int km_subscriber_resync_worker(km_subscriber *sub, uint32_t worker);

/* ---- the index ---------------------------------------------------------------------------------- */

/* km_feed_flush under the lock. Call between scoring batches, on the thread that scores. */
int km_subscriber_flush(km_subscriber *sub, km_feed_flush_stats *stats);

/* Write a consistent snapshot (flush, then index + feed state; atomic) to path (NULL =
 * config.snapshot_path), under the lock. It flushes, so call it where km_subscriber_flush may be
 * called (the scoring thread). A background snapshot still being written is waited for first, so
 * this one is the newest; that wait does not hold the lock: events keep being received and
 * flushes return meanwhile (starting no other background snapshot). SIGTERM handling belongs to
 * the daemon, which calls this on shutdown. Errors: KM_ERR_NULL_POINTER (no path), those of
 * km_feed_save (KM_ERR_IO ...). */
int km_subscriber_save(km_subscriber *sub, const char *path);

/* ---- inspection (any thread) ------------------------------------------------------------------- */

int km_subscriber_get_worker_info(km_subscriber *sub, uint32_t worker, km_feed_worker_info *out);
int km_subscriber_get_worker_windows(km_subscriber *sub, uint32_t worker, km_feed_window *out,
                                     uint32_t capacity, uint32_t *n_out);
int km_subscriber_get_workers(km_subscriber *sub, uint32_t *workers, uint32_t capacity,
                              uint32_t *n_out);

typedef struct km_subscriber_stats {
    uint64_t live_messages;     /* multipart messages received on SUB sockets */
    uint64_t replay_messages;   /* multipart messages received on DEALER sockets */
    uint64_t bytes_received;
    uint64_t malformed;         /* messages the decoder rejected (both sockets) */
    char last_malformed[640];   /* the latest of them: "worker 3, live: " + the decoder's reason
                                 * (km_kv_decoder_last_error: the frame, event and field, or the
                                 * limit exceeded); "" when none */
    uint64_t replay_requests;   /* requests sent */
    uint64_t replay_timeouts;
    uint64_t replay_send_failures;
    uint64_t wakeups;           /* zmq_poll returns */
    km_kv_decoder_stats decoder;
    bool restored;              /* restore_path was loaded */
    int restore_status;         /* KM_OK, or why restore_path was not loaded */
    char restore_error[256];    /* the restore's error in a sentence (km_feed_last_error); "" */
    /* A snapshot that failed to restore is never overwritten: before the first snapshot written to
     * its path, the file is moved to "<path>.unrestorable-<UTC time, YYYYmmddTHHMMSSZ>" (".N"
     * appended when that name is taken), logged at error level, and its new name kept here; ""
     * while it has not been moved. If it cannot be moved, snapshots to its path fail (counted in
     * snapshot_failures) and it stays. */
    char unrestorable_kept_as[4160];
    uint64_t snapshots;         /* snapshots written (periodic and km_subscriber_save) */
    uint64_t snapshot_failures;
    char last_snapshot_error[256];
} km_subscriber_stats;

int km_subscriber_get_stats(km_subscriber *sub, km_subscriber_stats *out);

/* ---- endpoints ---------------------------------------------------------------------------------- */

/* The endpoint of data-parallel rank `rank`, as vLLM derives it (offset_endpoint_port): rank 0 is
 * the endpoint itself; "tcp://host:P" becomes "tcp://host:(P + rank)"; an inproc endpoint gets
 * "_dp<rank>" appended. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (no port, a port past
 * 65535, another transport), KM_ERR_TOO_LARGE (out_size too small). */
int km_endpoint_for_rank(const char *endpoint, uint32_t rank, char *out, size_t out_size);

#ifdef __cplusplus
}
#endif
#endif
