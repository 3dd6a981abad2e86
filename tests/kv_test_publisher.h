/* SPDX-License-Identifier: Apache-2.0 */
/* Test-only helpers for the KV-event feed and subscriber suites (compiled into the test binary):
 *
 *  - km_test_batch: builds one msgpack payload `[ts, events, data_parallel_rank]` exactly as vLLM's
 *    msgspec encoder lays it out, in either event encoding (positional arrays, or v0.26+ maps) and
 *    with int or bytes block hashes;
 *  - km_test_engine: a simulated engine prefix cache that emits realistic BlockStored /
 *    BlockRemoved / AllBlocksCleared events (stores continue cached blocks, evicted blocks can be
 *    stored again under the same engine hash, engine hashes change when the process restarts) and
 *    knows the chain hashes it holds (the truth the index is compared with);
 *  - km_test_publisher: the library's km_publisher (include/kvmatch/publisher.h) with test
 *    conveniences (fixed ports, assert on failure, the log kept); it speaks the wire format of
 *    vLLM's ZmqEventPublisher:
 *    live messages [topic, seq(8, big-endian), payload] on a PUB socket (an XPUB, so a test can
 *    wait until its subscribers are connected), a ROUTER replay endpoint on its own thread that
 *    answers [empty, start_seq] requests from a bounded in-memory buffer (like vLLM's
 *    buffer_steps) in the v0.26 (with topic) or v0.25 / SGLang (without) reply form, and knobs to
 *    drop live messages (buffered but not delivered), restart at seq 0, evict history, hold or
 *    mute replay, and send raw malformed frames. Loopback only; ephemeral ports by default.
 *
 * Every published payload is also logged in order, so a test can rebuild the index a gap-free run
 * would have produced (km_test_reference_index). */
#ifndef KM_KV_TEST_PUBLISHER_H
#define KM_KV_TEST_PUBLISHER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "kvmatch/feed.h"
#include "kvmatch/kv_events.h"
#include "test_util.h"

/* ---- payloads ------------------------------------------------------------------------------- */

typedef enum km_test_encoding {
    KM_TEST_ENCODING_POSITIONAL = 0, /* ["BlockStored", hashes, parent, tokens, ...] */
    KM_TEST_ENCODING_MAP = 1,        /* {"type": "BlockStored", "block_hashes": ...} */
} km_test_encoding;

typedef enum km_test_hash_form {
    KM_TEST_HASH_INT = 0,     /* msgpack integers (uint64; values >= 2^63 as such) */
    KM_TEST_HASH_BYTES32 = 1, /* 32 raw bytes whose last 8 are the id big-endian (sha256 form) */
    KM_TEST_HASH_BYTES16 = 2, /* 16 raw bytes (xxh3-128 form) */
} km_test_hash_form;

typedef struct km_test_batch {
    km_test_encoding encoding;
    km_test_hash_form hash_form;
    int64_t dp_rank; /* < 0: the rank element is omitted (old engines) */
    double timestamp;
    uint32_t n_events;
    msgpack_sbuffer events; /* packed events, without the array header */
    msgpack_sbuffer payload;
} km_test_batch;

void km_test_batch_init(km_test_batch *b, km_test_encoding encoding, km_test_hash_form hash_form,
                        int64_t dp_rank);
void km_test_batch_free(km_test_batch *b);
/* Empty the batch for reuse (same encoding, form and rank). */
void km_test_batch_reset(km_test_batch *b);
void km_test_batch_stored(km_test_batch *b, const uint64_t *hashes, uint32_t n, bool has_parent,
                          uint64_t parent, const uint32_t *tokens, uint32_t block_size,
                          const char *lora_name, const char *medium);
/* km_test_batch_stored with vLLM's extra_keys (base model): block 0's entry carries cache_salt
 * (NULL: none) and block i's a multimodal (identifier, 0) pair when images[i] is not NULL (images
 * NULL: none); an entry with nothing is nil. With both NULL, extra_keys is nil (omitted), as
 * vLLM's CPU offloading connector sends it. */
void km_test_batch_stored_extra_keys(km_test_batch *b, const uint64_t *hashes, uint32_t n,
                                     bool has_parent, uint64_t parent, const uint32_t *tokens,
                                     uint32_t block_size, const char *medium,
                                     const char *cache_salt, const char *const *images);
void km_test_batch_removed(km_test_batch *b, const uint64_t *hashes, uint32_t n,
                           const char *medium);
void km_test_batch_cleared(km_test_batch *b);
/* The packed payload; valid until the next call on b. */
const void *km_test_batch_payload(km_test_batch *b, size_t *size);

/* ---- a simulated engine --------------------------------------------------------------------- */

typedef struct km_test_block {
    uint64_t engine_hash;
    uint64_t chain; /* kvmatch chain hash (docs/HASHING.md) with the engine's LoRA */
    int64_t parent; /* index in blocks, -1 for a first block */
    uint32_t *tokens;
    bool cached;
} km_test_block;

typedef struct km_test_engine {
    uint32_t block_size;
    const char *lora_name; /* NULL = base model */
    const char *medium;    /* NULL = GPU (field omitted / nil) */
    uint64_t process_seed; /* engine hashes depend on it, like vLLM's NONE_HASH */
    km_test_block *blocks; /* every block ever created (the universe of chain hashes) */
    size_t n_blocks, capacity;
} km_test_engine;

void km_test_engine_init(km_test_engine *e, uint32_t block_size, uint64_t process_seed);
void km_test_engine_free(km_test_engine *e);
/* Append 1..max_events random events to b; clear_percent: chance of an AllBlocksCleared. */
void km_test_engine_step(km_test_engine *e, km_rng *r, km_test_batch *b, uint32_t max_events,
                         uint32_t clear_percent);
/* Store `n` new blocks continuing block `parent` (-1: a new sequence); returns the first index. */
size_t km_test_engine_store(km_test_engine *e, km_rng *r, km_test_batch *b, int64_t parent,
                            uint32_t n);
/* A new process: nothing cached, new engine hashes for the same content. */
void km_test_engine_restart(km_test_engine *e, uint64_t process_seed);
/* Chain hashes of the cached blocks (*n_out = count); every chain ever made when all is true. */
uint64_t *km_test_engine_chains(const km_test_engine *e, bool all, size_t *n_out);

/* ---- index comparison ----------------------------------------------------------------------- */

/* Same holders for worker wa in a and worker wb in b over every hash of `universe`, and the same
 * block count for those workers. Returns 1 or 0 with why. */
int km_test_index_same(const km_index *a, uint32_t wa, const km_index *b, uint32_t wb,
                       const uint64_t *universe, size_t n, char *why, size_t why_size);
/* Worker w of index holds exactly `chains` (nothing else: its block count equals n). */
int km_test_index_holds_exactly(const km_index *index, uint32_t w, const uint64_t *chains,
                                size_t n, char *why, size_t why_size);
/* An index for tests: CPU backend, 2 threads, quiet log. */
km_index *km_test_make_index(uint32_t max_workers);
/* km_feed_config with a quiet log. */
void km_test_feed_config(km_feed_config *cfg, uint32_t block_size);

/* ---- the publisher -------------------------------------------------------------------------- */

typedef struct km_test_publisher km_test_publisher;

typedef enum km_test_replay_form {
    KM_TEST_REPLAY_WITH_TOPIC = 0, /* vLLM v0.26+: [empty, topic, seq, payload] at the DEALER */
    KM_TEST_REPLAY_NO_TOPIC = 1,   /* vLLM <= v0.25, SGLang: [empty, seq, payload] */
} km_test_replay_form;

typedef struct km_test_publisher_config {
    uint16_t port;        /* 0 = ephemeral */
    uint16_t replay_port; /* 0 = ephemeral */
    bool replay;          /* bind a replay endpoint */
    const char *topic;    /* NULL = "" */
    uint32_t buffer_steps; /* replay buffer length; 0 = 10,000 */
    km_test_replay_form replay_form;
} km_test_publisher_config;

void km_test_publisher_config_init(km_test_publisher_config *cfg);
/* Returns KM_OK, or KM_ERR_IO when a socket cannot be bound (e.g. the port is taken). */
int km_test_publisher_start(const km_test_publisher_config *cfg, km_test_publisher **out);
void km_test_publisher_stop(km_test_publisher *p); /* NULL is a no-op */
const char *km_test_publisher_endpoint(const km_test_publisher *p);        /* tcp://127.0.0.1:P */
const char *km_test_publisher_replay_endpoint(const km_test_publisher *p); /* NULL without */
uint16_t km_test_publisher_port(const km_test_publisher *p);
uint16_t km_test_publisher_replay_port(const km_test_publisher *p);

/* Publish one payload: assign the next seq, keep it in the replay buffer and the log, send it
 * live unless live delivery is being dropped. Returns the seq. */
uint64_t km_test_publisher_publish(km_test_publisher *p, const void *payload, size_t size);
/* Publish b's payload. */
uint64_t km_test_publisher_publish_batch(km_test_publisher *p, km_test_batch *b);
/* While on, published messages are buffered (replayable) but never reach subscribers: a drop on
 * the wire, which only the seq numbers reveal. */
void km_test_publisher_drop_live(km_test_publisher *p, bool drop);
/* A new engine process on the same endpoints: seq restarts at 0, the replay buffer is empty. */
void km_test_publisher_restart(km_test_publisher *p);
/* Keep only the newest `keep` messages in the replay buffer. */
void km_test_publisher_evict(km_test_publisher *p, uint32_t keep);
/* Hold replay requests (answered when released), or mute them (never answered). */
void km_test_publisher_hold_replay(km_test_publisher *p, bool hold);
void km_test_publisher_mute_replay(km_test_publisher *p, bool mute);
/* Pause between replayed messages, so live traffic interleaves with a replay. */
void km_test_publisher_replay_delay_us(km_test_publisher *p, uint32_t us);
/* The next replay answer loses `count` items after its first `after` (km_publisher's). */
void km_test_publisher_drop_replay_items(km_test_publisher *p, uint32_t after, uint32_t count);
/* Replay requests received (held and muted ones included). */
uint64_t km_test_publisher_replay_requests(km_test_publisher *p);
uint64_t km_test_publisher_next_seq(km_test_publisher *p);
/* Send arbitrary frames on the live socket (malformed input). Returns 0 or -1. */
int km_test_publisher_send_frames(km_test_publisher *p, const km_kv_frame *frames, size_t n);
/* Wait until `n` subscriptions in total have reached the publisher (so a live message published
 * now reaches them). Returns true when reached before timeout_ms. */
bool km_test_publisher_wait_subscribers(km_test_publisher *p, uint32_t n, int timeout_ms);

/* Everything published since start (restarts included), in order. */
size_t km_test_publisher_log_count(km_test_publisher *p);
const void *km_test_publisher_log_entry(km_test_publisher *p, size_t i, uint64_t *seq,
                                        size_t *size);

/* The index a gap-free run produces: decode every logged payload in order and feed it to a fresh
 * feed (no replay) for `worker` in a fresh index. Caller destroys it. */
km_index *km_test_reference_index(km_test_publisher *p, uint32_t max_workers, uint32_t worker,
                                  const km_feed_config *cfg);

/* Sleep for ms milliseconds. */
void km_test_sleep_ms(unsigned ms);

#endif
