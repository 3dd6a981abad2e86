/* SPDX-License-Identifier: Apache-2.0 */
/* A simulated inference engine for `kvmatch sim` (docs/SIM_ENGINE.md): a vLLM-v1-like prefix cache
 * with LRU eviction, the KV events it would publish in vLLM's exact msgpack wire format, and a
 * step-based time model with continuous batching.
 *
 * Deterministic, single-threaded, and it has no clock: every call that moves time takes `now_us`,
 * a virtual time in microseconds chosen by the caller (the simulator). The same calls in the same
 * order give the same results, events and bytes.
 *
 * Two ways to drive it; an engine is driven one way only (the first call of either group decides,
 * a call of the other group then fails with KM_ERR_INVALID_ARGUMENT):
 *
 *  - Cache operations (the caller does the scheduling): km_sim_engine_admit ->
 *    km_sim_engine_complete_prefill -> km_sim_engine_finish, with km_sim_engine_end_step closing
 *    the events produced so far into one message.
 *  - The step scheduler (the engine schedules itself, like vLLM's EngineCore loop):
 *    km_sim_engine_submit queues a request; km_sim_engine_advance(now) runs every engine step that
 *    ends at or before now; km_sim_engine_next_completion reports what happened (admitted with its
 *    real cached tokens, first token, finished, rejected) with the virtual time it happened at.
 *    km_sim_engine_next_event_us says when the engine next needs advancing.
 *
 * Either way, km_sim_engine_take_message hands out the event messages (seq + msgpack payload) in
 * order; km_sim_engine_holds / km_sim_engine_cached_depth are the ground truth of what the engine
 * caches now, by kvmatch chain hash (docs/HASHING.md, no LoRA, no salt).
 *
 * Lifecycle: km_sim_engine_config_init -> adjust -> km_sim_engine_create -> any number of the calls
 * above (and km_sim_engine_restart) -> km_sim_engine_destroy. Not thread-safe: one thread per
 * engine. Every failing call returns a negative km_status, changes nothing, and leaves a sentence
 * in km_sim_engine_last_error. */
#ifndef KM_SIM_ENGINE_H
#define KM_SIM_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/engine_model.h"
#include "kvmatch/error.h"

typedef struct km_sim_engine km_sim_engine;

/* Largest request id accepted (ids above are reserved for the engine's bookkeeping). */
#define KM_SIM_ENGINE_MAX_REQUEST_ID (UINT64_MAX - 2u)

typedef struct km_sim_engine_config {
    /* Speed, memory and scheduler limits (include/kvmatch/engine_model.h): block size, KV
     * capacity in blocks, the per-step token budget (max_num_batched_tokens), max_num_seqs and the
     * step-time constants. Default: the KM_ENGINE_MODEL_DEFAULT_PRESET preset. */
    km_engine_model model;
    /* Engine hashes are XXH3-64(chain hash, seed = process_seed): random-looking, equal for equal
     * content within one process, different after a restart with another seed (vLLM's NONE_HASH
     * is random per process). Default 1. */
    uint64_t process_seed;
    uint32_t data_parallel_rank; /* third element of every payload; default 0 */
    /* After km_sim_engine_restart, publish one AllBlocksCleared message (seq 0) at once. vLLM emits
     * nothing when a process dies and a new one starts; default false. */
    bool clear_on_restart;
} km_sim_engine_config;

void km_sim_engine_config_init(km_sim_engine_config *cfg);

/* cfg NULL = defaults. Errors: KM_ERR_NULL_POINTER (out), KM_ERR_BLOCK_SIZE, KM_ERR_INVALID_ARGUMENT
 * (a model km_engine_model_validate refuses, or capacity_blocks UINT32_MAX), KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_create(const km_sim_engine_config *cfg, km_sim_engine **out);
void km_sim_engine_destroy(km_sim_engine *engine); /* NULL is a no-op */

/* Detail of the last failed call ("" after a success). Valid until the next call. */
const char *km_sim_engine_last_error(const km_sim_engine *engine);

/* ---- cache operations ------------------------------------------------------------------------- */

/* What an admission found and did. */
typedef struct km_sim_admission {
    uint32_t prompt_tokens;
    uint32_t full_blocks;    /* prompt_tokens / block_size */
    uint32_t held_blocks;    /* leading full blocks the engine held (in use or free) */
    uint32_t hit_blocks;     /* blocks counted as a hit: min(held, (prompt_tokens - 1) / bs) */
    uint32_t cached_tokens;  /* hit_blocks * block_size: what vLLM reports as cached */
    uint32_t uncached_tokens; /* prompt_tokens - cached_tokens: what prefill computes */
    uint32_t new_blocks;     /* blocks allocated (rest of the prompt + reserved output space) */
    uint32_t evicted_blocks; /* cached free blocks evicted to make room */
} km_sim_admission;

/* Admit a request: look up its longest cached prefix, reference those blocks, allocate new ones
 * for the rest of the prompt plus `reserve_tokens` more (output space), evicting the oldest free
 * cached blocks as vLLM does (a BlockRemoved per evicted block joins the pending events). The
 * tokens are copied. out may be NULL.
 * Errors (nothing changes): KM_ERR_NULL_POINTER (tokens with n_tokens > 0), KM_ERR_INVALID_ARGUMENT
 * (n_tokens 0, request id in use or above KM_SIM_ENGINE_MAX_REQUEST_ID, scheduler mode),
 * KM_ERR_TOO_LARGE (needs more blocks than the capacity: it can never run),
 * KM_ERR_OVERLOADED (not enough free blocks now: retry after requests finish),
 * KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_admit(km_sim_engine *engine, uint64_t request_id, const uint32_t *tokens,
                        uint32_t n_tokens, uint32_t reserve_tokens, km_sim_admission *out);

/* The prompt's new full blocks are computed: cache them and queue one BlockStored per run of
 * newly cached blocks (normally one run). A block whose chain hash another block caches by now
 * (a concurrent request computed the same content) is not cached twice: it stays private to this
 * request and is freed empty. *stored_out (may be NULL) gets the number of blocks cached.
 * Errors: KM_ERR_NOT_FOUND (unknown request), KM_ERR_INVALID_ARGUMENT (already completed,
 * scheduler mode), KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_complete_prefill(km_sim_engine *engine, uint64_t request_id,
                                   uint32_t *stored_out);

/* The request is done (or aborted): its references are dropped and each block whose count reaches
 * zero goes to the tail of the free queue, the request's last block first, so its tail is evicted
 * before its head; cached blocks stay cached (hits remain possible) until evicted.
 * Errors: KM_ERR_NOT_FOUND, KM_ERR_INVALID_ARGUMENT (scheduler mode). */
int km_sim_engine_finish(km_sim_engine *engine, uint64_t request_id);

/* Close the pending events into one message with the next seq and timestamp now_us / 1e6
 * (virtual seconds). Nothing happens when no event is pending (vLLM publishes only non-empty
 * batches). *published_out (may be NULL) gets 1 when a message was made. Errors:
 * KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_end_step(km_sim_engine *engine, uint64_t now_us, int *published_out);

/* ---- the step scheduler ------------------------------------------------------------------------- */

typedef enum km_sim_completion_kind {
    KM_SIM_ADMITTED = 1,    /* a step started its prefill; cached_tokens is the real reuse */
    KM_SIM_FIRST_TOKEN = 2, /* the prefill step ended: the first output token exists */
    KM_SIM_FINISHED = 3,    /* the last output token was produced; blocks released */
    KM_SIM_REJECTED = 4,    /* can never fit in the cache (status KM_ERR_TOO_LARGE) */
} km_sim_completion_kind;

typedef struct km_sim_completion {
    uint64_t request_id;
    km_sim_completion_kind kind;
    uint64_t time_us;        /* virtual time it happened */
    uint64_t submit_us;      /* when it was submitted */
    uint32_t prompt_tokens;
    uint32_t cached_tokens;  /* ADMITTED onwards: tokens reused from the prefix cache */
    uint32_t held_blocks;    /* ADMITTED onwards: leading blocks the engine held at admission */
    uint32_t output_tokens;  /* tokens generated so far */
    int status;              /* KM_OK, or the reason of a rejection */
} km_sim_completion;

/* Queue a request at virtual time now_us (submissions come in time order). output_tokens 0 counts
 * as 1: an engine always produces the first token. Blocks for the whole prompt and output are
 * reserved at admission, so a running request is never preempted. Tokens are copied.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (n_tokens 0, id in use or too large,
 * now_us before the previous submission, cache-operation mode), KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_submit(km_sim_engine *engine, uint64_t request_id, const uint32_t *tokens,
                         uint32_t n_tokens, uint32_t output_tokens, uint64_t now_us);

/* km_sim_engine_submit with the answer's token ids known: `tokens` holds the n_tokens of the prompt
 * and then the first n_answer tokens the request will generate (n_answer <= max(output_tokens, 1)).
 * As vLLM v1 does with generated tokens, each block those tokens fill (the prompt's partial last
 * block first) is cached when the decode step that completes it is scheduled and published as a
 * BlockStored when that step ends, under the chain of the prompt and answer: a later prompt that
 * re-sends the answer (a conversation's next turn) hits it. The last token generated is never
 * computed (the request ends with it), so a block it would complete is not cached; nor are blocks
 * of tokens past n_answer (their ids are unknown). Errors as km_sim_engine_submit, and
 * KM_ERR_INVALID_ARGUMENT when n_answer exceeds the output, KM_ERR_TOO_LARGE when prompt and answer
 * fill more than 2^32 - 1 blocks (checked before the tokens are read). */
int km_sim_engine_submit_answered(km_sim_engine *engine, uint64_t request_id,
                                  const uint32_t *tokens, uint32_t n_tokens, uint32_t n_answer,
                                  uint32_t output_tokens, uint64_t now_us);

/* Run the engine up to now_us: every step that ends at or before now_us completes (its events
 * become one message, its completions are queued), and the next step starts as soon as there is
 * work. Steps start at the end of the previous one, or when an idle engine gets a request.
 * Errors: KM_ERR_INVALID_ARGUMENT (cache-operation mode), KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_advance(km_sim_engine *engine, uint64_t now_us);

/* When the engine next needs km_sim_engine_advance: the end of the running step, or the start of
 * the next one; UINT64_MAX when idle with nothing queued. */
uint64_t km_sim_engine_next_event_us(const km_sim_engine *engine);

/* Pop the oldest completion: 1 when *out was filled, 0 when none is queued. */
int km_sim_engine_next_completion(km_sim_engine *engine, km_sim_completion *out);

/* ---- events ------------------------------------------------------------------------------------- */

/* One published message: what vLLM's ZmqEventPublisher sends as frames [topic, seq, payload]. */
typedef struct km_sim_message {
    uint64_t seq;           /* from 0 per process (restart), +1 per message */
    uint64_t time_us;       /* virtual time it was published */
    uint32_t n_events;
    const uint8_t *payload; /* msgpack [ts: float64, [events...], data_parallel_rank] */
    size_t payload_size;
} km_sim_message;

/* Events produced but not yet closed into a message. The scheduler evicts when a step starts
 * (admission) and publishes when it ends, like vLLM: while this is non-zero the cache already
 * differs from what the published messages describe. */
uint32_t km_sim_engine_pending_events(const km_sim_engine *engine);

/* Pop the oldest published message: 1 when *out was filled, 0 when none. The payload stays valid
 * until the next km_sim_engine_take_message or km_sim_engine_destroy. */
int km_sim_engine_take_message(km_sim_engine *engine, km_sim_message *out);

/* ---- faults ------------------------------------------------------------------------------------- */

/* The engine process dies and a new one starts at now_us with process_seed new_seed: every block
 * is dropped, every request (queued, prefilling, decoding) is lost without a completion, events not
 * yet closed into a message are lost, and seq starts again at 0 (messages already published stay
 * takeable: they left the old process before it died). With clear_on_restart one AllBlocksCleared
 * message (seq 0) is published at once. Errors: KM_ERR_OUT_OF_MEMORY. */
int km_sim_engine_restart(km_sim_engine *engine, uint64_t new_seed, uint64_t now_us);

/* ---- ground truth and counters ------------------------------------------------------------------ */

/* Does the engine cache the block with this chain hash now (in use or free, not yet evicted)? A
 * block the step scheduler cached when it scheduled the chunk computing it counts once that step
 * has ended and its BlockStored is queued: until then later requests hit it, but it has not been
 * computed, and no event has named it. The same for the two below. */
bool km_sim_engine_holds(const km_sim_engine *engine, uint64_t chain_hash);
/* Leading blocks of chains[0..n) the engine caches now. */
uint32_t km_sim_engine_cached_depth(const km_sim_engine *engine, const uint64_t *chains,
                                    uint32_t n);
/* The chain hashes cached now, in block order; *n_out gets the full count even when capacity is
 * short. */
void km_sim_engine_cached_chains(const km_sim_engine *engine, uint64_t *out, size_t capacity,
                                 size_t *n_out);
/* The engine hash a block with this chain hash gets in the current process. */
uint64_t km_sim_engine_engine_hash(const km_sim_engine *engine, uint64_t chain_hash);

typedef struct km_sim_engine_stats {
    uint64_t admissions;      /* requests admitted */
    uint64_t admission_waits; /* admissions refused for lack of free blocks (KM_ERR_OVERLOADED) */
    uint64_t rejected;        /* requests that can never fit */
    uint64_t prompt_tokens;   /* of admitted requests */
    uint64_t hit_blocks;      /* blocks counted as hits */
    uint64_t cached_tokens;   /* hit tokens */
    uint64_t blocks_stored;   /* blocks cached by prefills, counted as a BlockStored names them */
    uint64_t duplicate_blocks; /* computed blocks left private because the content was cached */
    uint64_t blocks_evicted;  /* BlockRemoved */
    uint64_t messages;        /* published, this process */
    uint64_t messages_total;  /* published, all processes */
    uint64_t restarts;
    uint64_t steps;           /* scheduler steps completed */
    uint64_t busy_us;         /* virtual time spent in steps */
    uint64_t finished;        /* requests finished */
    uint32_t blocks_cached;   /* now (a scheduled chunk's blocks too, before their BlockStored) */
    uint32_t blocks_in_use;   /* now: referenced by a request */
    uint32_t blocks_free;     /* now: in the free queue (empty or cached) */
    uint32_t waiting;         /* now: submitted, not admitted */
    uint32_t running;         /* now: admitted, not finished */
    uint64_t seq_next;        /* the seq the next message gets */
} km_sim_engine_stats;

void km_sim_engine_get_stats(const km_sim_engine *engine, km_sim_engine_stats *out);
const km_sim_engine_config *km_sim_engine_get_config(const km_sim_engine *engine);

#endif
