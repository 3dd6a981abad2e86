/* SPDX-License-Identifier: Apache-2.0 */
/* Decoder for the KV-cache events that vLLM and SGLang workers publish over ZMQ
 * (docs/EVENTS.md; the wire format is vLLM's `vllm/distributed/kv_events.py`).
 *
 * The decoder turns the frames of one ZMQ message into a typed, validated batch of events. It
 * accepts every shape the publishers have used (positional or map events, omitted trailing
 * defaults, unknown fields, integer or bytes block hashes, both replay reply forms) and rejects
 * anything else with KM_ERR_PARSE or KM_ERR_TOO_LARGE and a sentence naming the frame, event and
 * field. It does no I/O and keeps no state between messages except reusable memory and counters:
 * sequence tracking, replay and the index updates belong to the subscriber built on top of it.
 *
 * Lifecycle: km_kv_decoder_config_init -> adjust the limits -> km_kv_decoder_create -> any number
 * of km_kv_decode_message / km_kv_decode_payload -> km_kv_decoder_destroy. A handle is not
 * thread-safe; use one per subscriber thread.
 *
 * Memory: everything a decode returns (events, hash and token arrays, strings, the topic) lives in
 * storage owned by the handle and stays valid until the next decode call on the same handle or
 * km_kv_decoder_destroy. The caller may release the frames as soon as the call returns. The
 * storage is reused: once it has grown to fit the largest message seen, decoding allocates nothing.
 * It never exceeds what the configured limits allow (see km_kv_decoder_config).
 *
 * Errors. A decode returns KM_OK or a negative km_status, and km_kv_decoder_last_error() then holds
 * the detail. Two levels, so that one odd event cannot hide a whole step's worth of good ones:
 *  - The whole message is rejected (nothing is returned) when its framing is wrong, the payload
 *    is not exactly one well-formed msgpack value, any value has a type the format does not allow
 *    where it stands (including every element of every array), a required field is missing, or a
 *    configured limit is exceeded. Such a message means the publisher speaks something this
 *    decoder does not understand, so no part of it is trusted.
 *  - A single event that is well-typed but inconsistent (token_ids not block_size tokens per
 *    block, block_size outside 1..2^32-1 other than a placeholder store's 0, extra_keys not one
 *    entry per block, a NUL byte inside lora_name, medium or kv_cache_spec_kind) is left out of
 *    batch.events and reported in
 *    batch.rejected; the rest of the batch is returned and the call succeeds. Everything in
 *    batch.events is therefore consistent and safe to apply as is.
 *  - An event of an unknown type is skipped and counted (batch.n_unknown_events): newer engines
 *    may add types, and they must not break older routers.
 *
 * Block hashes. The engine's hashes are delivered as u64 ids: a msgpack uint64 as it is, a negative
 * int64 as its two's-complement bits, and raw bytes (1..64 long; vLLM sends 32 for sha256, 16 for
 * xxh3-128 when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) as their big-endian value modulo 2^64, that
 * is, the last min(len, 8) bytes read big-endian. That is exactly the integer vLLM itself publishes
 * for the same block when the variable is 1 (`int.from_bytes(h, "big") & (2**64 - 1)`), so a
 * worker's ids do not depend on that setting. These ids are opaque per-worker names; kvmatch's own
 * chain hashes are recomputed from token_ids (docs/HASHING.md). */
#ifndef KVMATCH_KV_EVENTS_H
#define KVMATCH_KV_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_kv_decoder km_kv_decoder;

/* The version of the event contract below. 2: a BlockStored may be a placeholder store
 * (km_kv_event.placeholder, block_size 0); version 1 refused every block_size 0. */
#define KM_KV_EVENTS_CONTRACT_VERSION 2

/* The seq value of the replay end marker (8 bytes of 0xFF on the wire). */
#define KM_KV_REPLAY_END_SEQ UINT64_MAX
/* Deepest container nesting a payload may have: msgpack-c's unpacker holds at most 32 open
 * containers. Valid batches nest 6 deep at most (batch, events, event, extra_keys, entry, item). */
#define KM_KV_MAX_NESTING_DEPTH 32u
/* Longest bytes block hash accepted. */
#define KM_KV_MAX_BYTES_HASH 64u

/* Hard limits. Every one must be >= 1. A payload over any of them fails with KM_ERR_TOO_LARGE and a
 * message naming the limit. The handle's memory is bounded by about
 * 24 * max_payload_objects bytes (msgpack-c's object tree) plus the decoded arrays
 * (8 bytes per hash, 4 per token, ~150 bytes per event), all retained for reuse. */
typedef struct km_kv_decoder_config {
    uint64_t max_payload_bytes;    /* payload frame size; default 64 MiB */
    uint32_t max_payload_objects;  /* msgpack values in one payload, map keys and values included;
                                    * default 1 << 22 (4 Mi) */
    uint32_t max_events_per_batch; /* entries of the events array, unknown types included;
                                    * default 1 << 16 */
    uint32_t max_hashes_per_event; /* block_hashes of one event; default 1 << 20 */
    uint32_t max_tokens_per_event; /* token_ids of one BlockStored; default 1 << 22 */
    uint32_t max_string_bytes;     /* topic frame, lora_name, medium, kv_cache_spec_kind,
                                    * cache_salt (a longer one refuses the message); a salt in
                                    * extra_keys past it makes its chain opaque; default 1024 */
} km_kv_decoder_config;

/* Fill `cfg` with the defaults above. */
void km_kv_decoder_config_init(km_kv_decoder_config *cfg);
/* cfg NULL = defaults. Errors: KM_ERR_NULL_POINTER (out), KM_ERR_INVALID_ARGUMENT (a limit of 0),
 * KM_ERR_OUT_OF_MEMORY. */
int km_kv_decoder_create(const km_kv_decoder_config *cfg, km_kv_decoder **out);
void km_kv_decoder_destroy(km_kv_decoder *decoder); /* NULL is a no-op */

/* Detail of the last decode call on this handle when it failed ("KM_ERR_PARSE: event 3
 * (BlockStored), field token_ids[7]: expected an int in 0..2^32-1, got str"); "" after a success.
 * Valid until the next call on the handle. */
const char *km_kv_decoder_last_error(const km_kv_decoder *decoder);

/* ---- decoded events ----------------------------------------------------------------------- */

/* The two enums below are generated from X-macro lists of X(enumerator, value, name), so that an
 * enum and its *_name function can never drift apart. */
#define KM_KV_ENUM_ENTRY(enumerator, value, name) enumerator = value,

/* The name of an event kind is its wire name. */
#define KM_KV_EVENT_KIND_LIST(X)                                                               \
    X(KM_KV_EVENT_BLOCK_STORED, 1, "BlockStored")           /* the worker now holds these     \
                                                             * blocks */                      \
    X(KM_KV_EVENT_BLOCK_REMOVED, 2, "BlockRemoved")         /* the worker evicted these       \
                                                             * blocks */                      \
    X(KM_KV_EVENT_ALL_BLOCKS_CLEARED, 3, "AllBlocksCleared") /* the worker dropped its whole   \
                                                              * prefix cache */

typedef enum km_kv_event_kind {
    KM_KV_EVENT_KIND_LIST(KM_KV_ENUM_ENTRY)
} km_kv_event_kind;

/* The storage medium an event is about, from the strings vLLM, SGLang and their KV connectors
 * publish (any letter case; docs/EVENTS.md, "Media"). nil (and an absent field) means GPU. */
#define KM_KV_MEDIUM_LIST(X)                                                                   \
    X(KM_KV_MEDIUM_GPU, 0, "GPU")     /* "GPU", "cuda", "cuda:<n>", nil, absent */             \
    X(KM_KV_MEDIUM_CPU, 1, "CPU")     /* host memory: "CPU", "CPU_PINNED" */                   \
    X(KM_KV_MEDIUM_DISK, 2, "DISK")   /* "DISK", "STORAGE" */                                  \
    X(KM_KV_MEDIUM_OTHER, 3, "other") /* any other string; medium_name says which */           \
    X(KM_KV_MEDIUM_EXTERNAL, 4, "EXTERNAL") /* a shared or remote pool: "EXTERNAL" */
#define KM_KV_MEDIUM_COUNT 5u

typedef enum km_kv_medium {
    KM_KV_MEDIUM_LIST(KM_KV_ENUM_ENTRY)
} km_kv_medium;

/* One valid event. Fields not used by a kind are zero / NULL. Arrays and strings are owned by the
 * decoder (see "Memory" above); strings are NUL-terminated and have no NUL inside unless stated. */
typedef struct km_kv_event {
    km_kv_event_kind kind;
    uint32_t position; /* index of this event in the payload's events array (counting skipped and
                        * rejected events), for logs */

    /* BLOCK_STORED and BLOCK_REMOVED */
    const uint64_t *block_hashes; /* engine hashes as u64 ids (rule above), one per full block */
    uint32_t n_block_hashes;      /* may be 0 */
    km_kv_medium medium;
    const char *medium_name; /* the string as sent; NULL when nil or absent */
    bool has_group_idx;      /* KV cache group (hybrid models); absent or nil -> false */
    uint32_t group_idx;

    /* BLOCK_STORED only */
    bool has_parent_block_hash; /* false: block_hashes[0] starts a sequence (nil on the wire) */
    uint64_t parent_block_hash; /* engine hash of the block before block_hashes[0] */
    const uint32_t *token_ids;  /* block_size * n_block_hashes tokens, checked (or sparse_blocks) */
    uint32_t n_token_ids;
    /* A KV-cache group that keeps only some blocks of a range (vLLM's Mamba align mode, a
     * sliding window's tail) publishes the token_ids of the whole range with the hashes of the
     * blocks it keeps, without saying which those are: true for an event with group_idx whose
     * token_ids are a whole number of blocks, more of them than block hashes (at least one). Its
     * tokens cannot be hashed block by block. */
    bool sparse_blocks;
    uint32_t block_size;   /* >= 1, checked; 0 exactly for a placeholder store */
    /* A placeholder store: block_size 0 on the wire, no token_ids, no parent (nil or absent), no
     * lookahead tokens, and a medium other than the GPU (the same event on the GPU medium is
     * rejected for its block size). vLLM's OffloadingConnector publishes each chunk it stores in
     * a lower tier this way unless its self_describing_kv_events option is on: the block_hashes
     * name blocks the engine announced earlier with full stores, now held in this medium too;
     * there is nothing to hash. The other fields are decoded and checked as for any store. */
    bool placeholder;
    const char *lora_name; /* NULL when nil or absent (base model); "" is kept as "" */
    bool has_lora_id;      /* deprecated engine-local adapter id */
    int64_t lora_id;
    /* NULL when extra_keys is nil or absent; else n_block_hashes flags, 1 when that block's entry
     * is present and not empty (LoRA name, multimodal item ids, cache salt: vLLM mixes them into
     * the engine hash; their content is not decoded). */
    const uint8_t *extra_keys_present;
    /* NULL when extra_keys is nil or absent; else n_block_hashes flags, 1 when that block's entry
     * holds keys other than the LoRA adapter and the cache salt: multimodal item keys (arrays, or
     * bare strings from older engines), prompt-embedding digests (bytes) or anything unknown.
     * Hashing such a block from its tokens would name the wrong content (docs/EVENTS.md). */
    const uint8_t *extra_keys_opaque;
    /* The cache salt of an event that starts a sequence (no parent): SGLang's top-level
     * cache_salt field, else the salt recovered from block 0's extra_keys entry (vLLM appends it
     * after the LoRA and multimodal keys of the first block only). NULL when there is none. */
    const char *cache_salt;
    /* Lookahead hashing (vLLM with EAGLE / MTP speculative decoding): the engine's hash of block
     * i also covers the n_lookahead_tokens tokens after it, lookahead_token_ids[i * n .. (i+1) * n)
     * (checked: one list per block, all of one length >= 1). NULL / 0 when absent or nil. */
    const uint32_t *lookahead_token_ids;
    uint32_t n_lookahead_tokens;
    const char *kv_cache_spec_kind; /* NULL when nil or absent */
    bool has_kv_cache_spec_sliding_window;
    int64_t kv_cache_spec_sliding_window;
} km_kv_event;

/* Which consistency check a well-typed event failed. */
#define KM_KV_REJECTION_LIST(X)                                                                \
    X(KM_KV_REJECTED_BLOCK_SIZE, 1, "block_size")   /* block_size below 1 or above 2^32-1 */   \
    X(KM_KV_REJECTED_TOKEN_COUNT, 2, "token_count") /* token_ids not block_size per block */   \
    X(KM_KV_REJECTED_EXTRA_KEYS, 3, "extra_keys")   /* extra_keys not one entry per block */   \
    X(KM_KV_REJECTED_NUL_BYTE, 4, "nul_byte")       /* a NUL byte inside a string field */

typedef enum km_kv_rejection {
    KM_KV_REJECTION_LIST(KM_KV_ENUM_ENTRY)
} km_kv_rejection;

/* A well-typed event that failed a consistency check; left out of km_kv_batch.events. */
typedef struct km_kv_rejected_event {
    uint32_t position; /* index in the payload's events array */
    km_kv_event_kind kind;
    km_kv_rejection reason;
    int status;          /* KM_ERR_BLOCK_SIZE (block_size < 1 or > 2^32-1) or KM_ERR_PARSE */
    const char *message; /* "token_ids has 30 tokens, block_size 16 x 2 block_hashes needs 32" */
} km_kv_rejected_event;

/* One decoded payload: [ts, events, data_parallel_rank]. */
typedef struct km_kv_batch {
    double timestamp;            /* seconds since the epoch as the engine sent it (float or int) */
    bool has_data_parallel_rank; /* false when absent (old engines) or nil */
    uint32_t data_parallel_rank;
    const km_kv_event *events; /* the valid events, in payload order */
    uint32_t n_events;
    const km_kv_rejected_event *rejected; /* inconsistent events, in payload order */
    uint32_t n_rejected;
    uint32_t n_unknown_events;      /* events of an unknown type, skipped */
    const char *first_unknown_type; /* the first such type name (cut to 63 bytes, each NUL or
                                     * other control byte as '?'), NULL if none */
    uint32_t n_payload_events;      /* n_events + n_rejected + n_unknown_events */
} km_kv_batch;

/* Decode one msgpack payload (the last frame of a message). On error *out is zeroed.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_PARSE, KM_ERR_TOO_LARGE, KM_ERR_OUT_OF_MEMORY. */
int km_kv_decode_payload(km_kv_decoder *decoder, const void *payload, size_t payload_size,
                         km_kv_batch *out);

/* ---- whole ZMQ messages ------------------------------------------------------------------- */

/* Where the frames were received; the two sockets frame messages differently, and a live message
 * with the default empty topic looks exactly like an old-form replay reply. */
typedef enum km_kv_source {
    /* The SUB socket: exactly 3 frames [topic, seq, payload]. */
    KM_KV_SOURCE_SUBSCRIBER = 1,
    /* A DEALER connected to the replay (ROUTER) endpoint: [empty, seq, payload] (vLLM up to v0.25,
     * SGLang) or [empty, topic, seq, payload] (v0.26+). The first frame must be the empty
     * delimiter; a REQ socket strips it, so a REQ client prepends an empty frame before
     * decoding. */
    KM_KV_SOURCE_REPLAY = 2,
} km_kv_source;

typedef enum km_kv_message_kind {
    KM_KV_MESSAGE_LIVE = 1,        /* a batch from the SUB socket */
    KM_KV_MESSAGE_REPLAY_ITEM = 2, /* a buffered batch re-sent by the replay endpoint */
    KM_KV_MESSAGE_REPLAY_END = 3, /* seq = KM_KV_REPLAY_END_SEQ and an empty payload: replay done */
} km_kv_message_kind;

/* One frame of a multipart message, as received (e.g. zmq_msg_data / zmq_msg_size). */
typedef struct km_kv_frame {
    const void *data; /* may be NULL only when size is 0 */
    size_t size;
} km_kv_frame;

typedef struct km_kv_message {
    km_kv_message_kind kind;
    uint64_t seq;      /* the seq frame, 8 bytes big-endian; per publisher process, from 0 */
    bool has_topic;    /* false for the 3-frame replay form, which carries no topic */
    const char *topic; /* copy of the topic frame, NUL-terminated ("" when none); the frame may
                          * itself hold NUL bytes: use topic_size */
    uint32_t topic_size;
    km_kv_batch batch; /* zero for KM_KV_MESSAGE_REPLAY_END */
} km_kv_message;

/* Decode the frames of one multipart message. Checks, in order: the frame count for `source`, the
 * replay delimiter, the topic size, the seq frame (exactly 8 bytes), the payload (non-empty, except
 * for the replay end marker, which must be empty), then the payload as km_kv_decode_payload does.
 * On error *out is zeroed. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (unknown source),
 * KM_ERR_PARSE, KM_ERR_TOO_LARGE, KM_ERR_OUT_OF_MEMORY. */
int km_kv_decode_message(km_kv_decoder *decoder, km_kv_source source, const km_kv_frame *frames,
                         size_t n_frames, km_kv_message *out);

/* ---- counters and names ------------------------------------------------------------------- */

/* Totals over the handle's life. */
typedef struct km_kv_decoder_stats {
    uint64_t messages_decoded;  /* successful decode calls (messages or payloads) */
    uint64_t messages_rejected; /* failed decode calls */
    uint64_t events_decoded;    /* valid events returned */
    uint64_t events_rejected;   /* inconsistent events reported in km_kv_batch.rejected */
    uint64_t events_unknown;    /* events of unknown types skipped */
    uint64_t retained_bytes;    /* memory the handle holds for reuse now */
} km_kv_decoder_stats;

int km_kv_decoder_get_stats(const km_kv_decoder *decoder, km_kv_decoder_stats *out);

/* "BlockStored", "BlockRemoved", "AllBlocksCleared" (the wire names); "unknown" otherwise. */
const char *km_kv_event_kind_name(km_kv_event_kind kind);
/* "GPU", "CPU", "DISK", "other", "EXTERNAL"; "unknown" otherwise. */
const char *km_kv_medium_name(km_kv_medium medium);
/* "block_size", "token_count", "extra_keys", "nul_byte"; "unknown" otherwise. */
const char *km_kv_rejection_name(km_kv_rejection reason);

#ifdef __cplusplus
}
#endif
#endif
