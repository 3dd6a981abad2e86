/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed's copies of live messages: a message that arrives while a replay runs is copied
 * whole (km_feed_held_copy) and applied after the replay; a content digest (km_feed_message_digest)
 * recognises a late live copy of a message the replay already delivered. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "events/feed_internal.h"


static size_t align8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

/* The bytes a held copy of string s takes (none for NULL). */
static size_t held_string_bytes(const char *s)
{
    return s ? align8(strlen(s) + 1) : 0;
}

/* Copy string s to p + *at (NULL stays NULL), advancing *at past it. */
static const char *held_string(unsigned char *p, size_t *at, const char *s)
{
    if (!s)
        return NULL;
    size_t len = strlen(s) + 1;
    char *copy = (char *)(p + *at);
    memcpy(copy, s, len);
    *at += align8(len);
    return copy;
}

/* One allocation holding the message and deep copies of every field the feed reads from an event
 * (applying a held copy must give what applying the message would have). */
held_message *km_feed_held_copy(uint64_t seq, const km_kv_batch *batch)
{
    uint32_t n = batch ? batch->n_events : 0;
    size_t bytes = align8(sizeof(held_message)) + align8((size_t)n * sizeof(km_kv_event));
    for (uint32_t i = 0; i < n; i++) {
        const km_kv_event *e = &batch->events[i];
        bytes += align8((size_t)e->n_block_hashes * 8) + align8((size_t)e->n_token_ids * 4);
        if (e->extra_keys_present)
            bytes += align8(e->n_block_hashes);
        if (e->extra_keys_opaque)
            bytes += align8(e->n_block_hashes);
        bytes += held_string_bytes(e->lora_name) + held_string_bytes(e->cache_salt) +
                 held_string_bytes(e->medium_name) + held_string_bytes(e->kv_cache_spec_kind);
        bytes += align8((size_t)e->n_block_hashes * e->n_lookahead_tokens * 4);
    }
    unsigned char *p = malloc(bytes);
    if (!p)
        return NULL;
    held_message *m = (held_message *)p;
    size_t at = align8(sizeof(held_message));
    km_kv_event *events = (km_kv_event *)(p + at);
    at += align8((size_t)n * sizeof(km_kv_event));
    for (uint32_t i = 0; i < n; i++) {
        const km_kv_event *src = &batch->events[i];
        km_kv_event *dst = &events[i];
        *dst = *src;
        dst->medium_name = held_string(p, &at, src->medium_name);
        dst->kv_cache_spec_kind = held_string(p, &at, src->kv_cache_spec_kind);
        if (src->n_block_hashes) {
            memcpy(p + at, src->block_hashes, (size_t)src->n_block_hashes * 8);
            dst->block_hashes = (const uint64_t *)(p + at);
            at += align8((size_t)src->n_block_hashes * 8);
        } else {
            dst->block_hashes = NULL;
        }
        if (src->n_token_ids) {
            memcpy(p + at, src->token_ids, (size_t)src->n_token_ids * 4);
            dst->token_ids = (const uint32_t *)(p + at);
            at += align8((size_t)src->n_token_ids * 4);
        } else {
            dst->token_ids = NULL;
        }
        if (src->extra_keys_present) {
            if (src->n_block_hashes)
                memcpy(p + at, src->extra_keys_present, src->n_block_hashes);
            dst->extra_keys_present = p + at;
            at += align8(src->n_block_hashes);
        }
        if (src->extra_keys_opaque) {
            if (src->n_block_hashes)
                memcpy(p + at, src->extra_keys_opaque, src->n_block_hashes);
            dst->extra_keys_opaque = p + at;
            at += align8(src->n_block_hashes);
        }
        dst->lora_name = held_string(p, &at, src->lora_name);
        dst->cache_salt = held_string(p, &at, src->cache_salt);
        size_t lookahead_bytes = (size_t)src->n_block_hashes * src->n_lookahead_tokens * 4;
        if (lookahead_bytes) {
            memcpy(p + at, src->lookahead_token_ids, lookahead_bytes);
            dst->lookahead_token_ids = (const uint32_t *)(p + at);
            at += align8(lookahead_bytes);
        } else {
            dst->lookahead_token_ids = NULL;
        }
    }
    m->seq = seq;
    m->malformed = batch == NULL;
    m->timestamp = batch ? batch->timestamp : 0.0;
    m->n_events = n;
    m->events = events;
    m->bytes = bytes;
    return m;
}

/* Content digest of a message, to recognise a late live copy of a message a replay delivered. */
#define DIGEST_MALFORMED UINT64_C(0x6d616c666f726d64)

uint64_t km_feed_message_digest(const message_view *v)
{
    if (v->malformed)
        return DIGEST_MALFORMED;
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, &v->timestamp, sizeof v->timestamp);
    XXH3_64bits_update(&st, &v->n_events, sizeof v->n_events);
    for (uint32_t i = 0; i < v->n_events; i++) {
        const km_kv_event *e = &v->events[i];
        uint32_t head[4] = {(uint32_t)e->kind, e->n_block_hashes, e->block_size, (uint32_t)e->medium};
        XXH3_64bits_update(&st, head, sizeof head);
        if (e->n_block_hashes)
            XXH3_64bits_update(&st, e->block_hashes, (size_t)e->n_block_hashes * 8);
        if (e->has_parent_block_hash)
            XXH3_64bits_update(&st, &e->parent_block_hash, 8);
        if (e->n_token_ids)
            XXH3_64bits_update(&st, e->token_ids, (size_t)e->n_token_ids * 4);
        if (e->lora_name)
            XXH3_64bits_update(&st, e->lora_name, strlen(e->lora_name) + 1);
        if (e->cache_salt)
            XXH3_64bits_update(&st, e->cache_salt, strlen(e->cache_salt) + 1);
        if (e->n_lookahead_tokens)
            XXH3_64bits_update(&st, e->lookahead_token_ids,
                               (size_t)e->n_block_hashes * e->n_lookahead_tokens * 4);
    }
    uint64_t d = XXH3_64bits_digest(&st);
    return d == DIGEST_MALFORMED ? d + 1 : d;
}
