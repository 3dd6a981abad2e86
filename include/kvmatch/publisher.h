/* SPDX-License-Identifier: Apache-2.0 */
/* A KV-event publisher that speaks vLLM's ZmqEventPublisher wire format (docs/EVENTS.md): live
 * messages [topic, seq (8 bytes big-endian), payload] on a PUB socket, and a ROUTER replay endpoint
 * answering [identity, empty, start_seq] with every buffered message from start_seq on, then the
 * end marker (seq -1, empty payload), in the v0.26 form (with the topic frame) or the v0.25 /
 * SGLang form (without). For the simulator's engines and the tests: a real publisher the real
 * subscriber follows. It also carries the faults a simulation injects: live messages dropped on
 * the wire (still buffered, so replay can recover them), a restart (seq back to 0, history gone),
 * history evicted, replay held, muted or losing items on the way.
 *
 * Threads: one replay thread per publisher owns the ROUTER; km_publisher_publish and the fault
 * knobs may be called from any one thread at a time (the PUB socket is that thread's), the
 * counters from any thread. */
#ifndef KVMATCH_PUBLISHER_H
#define KVMATCH_PUBLISHER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/kv_events.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_publisher km_publisher;

typedef enum km_replay_form {
    KM_REPLAY_WITH_TOPIC = 0, /* vLLM v0.26+: [empty, topic, seq, payload] at the DEALER */
    KM_REPLAY_NO_TOPIC = 1,   /* vLLM <= v0.25, SGLang: [empty, seq, payload] */
} km_replay_form;

typedef struct km_publisher_config {
    const char *endpoint;        /* PUB bind address; default "tcp://127.0.0.1:*" (ephemeral) */
    const char *replay_endpoint; /* ROUTER bind address; default "tcp://127.0.0.1:*" */
    bool replay;                 /* bind the replay endpoint; default true */
    const char *topic;           /* NULL = "" (vLLM's default) */
    uint32_t buffer_steps;       /* messages kept for replay (vLLM's buffer_steps); default 10,000 */
    km_replay_form replay_form;  /* default KM_REPLAY_WITH_TOPIC */
    bool keep_log;               /* keep every payload ever published (tests rebuild a gap-free
                                  * reference from it); default false */
} km_publisher_config;

void km_publisher_config_init(km_publisher_config *cfg);

/* Bind the sockets and start the replay thread. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_INVALID_ARGUMENT (buffer_steps 0), KM_ERR_IO (an endpoint cannot be bound: why says
 * which and ZMQ's reason), KM_ERR_OUT_OF_MEMORY. */
int km_publisher_start(const km_publisher_config *cfg, km_publisher **out, char *why,
                       size_t why_size);
void km_publisher_stop(km_publisher *p); /* NULL is a no-op */

/* The bound endpoints ("tcp://127.0.0.1:41234"); the replay one is NULL without replay. */
const char *km_publisher_endpoint(const km_publisher *p);
const char *km_publisher_replay_endpoint(const km_publisher *p);

/* Publish one payload: assign the next seq, keep it for replay, send it live (unless live delivery
 * is being dropped). *seq_out (may be NULL) gets the seq. Errors: KM_ERR_OUT_OF_MEMORY (nothing
 * published, the seq is not used), KM_ERR_IO (buffered, but the live send failed). */
int km_publisher_publish(km_publisher *p, const void *payload, size_t size, uint64_t *seq_out);

/* ---- faults ---------------------------------------------------------------------------------- */

/* While on, published messages are buffered (replayable) but never reach subscribers: a drop on
 * the wire that only the seq numbers reveal. */
void km_publisher_drop_live(km_publisher *p, bool drop);
/* A new engine process on the same endpoints: seq restarts at 0, the replay buffer is empty. */
void km_publisher_restart(km_publisher *p);
/* Keep only the newest `keep` messages in the replay buffer. */
void km_publisher_evict(km_publisher *p, uint32_t keep);
/* Hold replay requests (answered when released), or mute them (never answered). */
void km_publisher_hold_replay(km_publisher *p, bool hold);
void km_publisher_mute_replay(km_publisher *p, bool mute);
/* Pause between replayed messages, so live traffic interleaves with a replay. */
void km_publisher_replay_delay_us(km_publisher *p, uint32_t us);
/* The next replay answer sends its first `after` items, loses the `count` after them on the way
 * (as a ROUTER drops what its peer's pipe cannot take), then sends the rest and its end marker.
 * Answers after it are whole. */
void km_publisher_drop_replay_items(km_publisher *p, uint32_t after, uint32_t count);
/* Send arbitrary frames on the live socket (malformed input). */
int km_publisher_send_frames(km_publisher *p, const km_kv_frame *frames, size_t n);

/* ---- inspection ------------------------------------------------------------------------------ */

uint64_t km_publisher_next_seq(km_publisher *p);
uint64_t km_publisher_replay_requests(km_publisher *p);
/* Wait until `n` subscriptions in total have reached the publisher (so a live message published
 * now reaches them). Returns true when reached before timeout_ms. Call from the publishing
 * thread. */
bool km_publisher_wait_subscribers(km_publisher *p, uint32_t n, int timeout_ms);
/* With keep_log: everything published since start (restarts included), in order. */
size_t km_publisher_log_count(km_publisher *p);
/* Entry i of the log (valid until the publisher stops); NULL when out of range. */
const void *km_publisher_log_entry(km_publisher *p, size_t i, uint64_t *seq, size_t *size);

#ifdef __cplusplus
}
#endif
#endif
