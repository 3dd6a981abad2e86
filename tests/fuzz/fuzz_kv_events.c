/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the KV-event decoder (include/kvmatch/kv_events.h).
 *
 * Input: one mode byte, then either a msgpack payload (mode % 3 == 0) or the frames of one ZMQ
 * message (1: SUB socket, 2: replay DEALER), each frame as a 4-byte big-endian length and its
 * bytes (the format of tests/kv_events_vectors/ *.frames; a short last frame takes what is left).
 * Mode bit 2 selects a decoder with tight limits. The frames are copied into their own
 * allocations, so a read past a frame's end is caught by ASan.
 *
 * Contracts checked: a failure has a negative code, a non-empty message and a zeroed result; a
 * success has an empty message and a batch whose every part is consistent (event counts add up,
 * positions increase, kinds are known, BlockStored has block_size >= 1 and block_size tokens per
 * hash, or is a placeholder store: block_size 0, no tokens, no parent, a medium other than the GPU;
 * arrays and strings are readable to their stated lengths, rejected events say why); the
 * decoder's counters move as documented; a payload decodes to the same batch (or the same error)
 * with the direct path on and off. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/kv_events.h"
#include "events/kv_events_internal.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

#define MAX_FRAMES 8

static km_kv_decoder *dec_default, *dec_tight;
/* The same configurations with the direct path off: every payload decodes to the same batch, or
 * fails with the same message, both ways (src/events/kv_events.c, "the direct path"). */
static km_kv_decoder *tree_default, *tree_tight;
static volatile uint64_t sink;

static void init(void)
{
    if (dec_default)
        return;
    km_kv_decoder_config tight;
    km_kv_decoder_config_init(&tight);
    tight.max_payload_bytes = 256;
    tight.max_payload_objects = 48;
    tight.max_events_per_batch = 3;
    tight.max_hashes_per_event = 4;
    tight.max_tokens_per_event = 16;
    tight.max_string_bytes = 6;
    CHECK(km_kv_decoder_create(NULL, &dec_default) == KM_OK);
    CHECK(km_kv_decoder_create(&tight, &dec_tight) == KM_OK);
    CHECK(km_kv_decoder_create(NULL, &tree_default) == KM_OK);
    CHECK(km_kv_decoder_create(&tight, &tree_tight) == KM_OK);
    km_kv_decoder_set_direct_path(tree_default, false);
    km_kv_decoder_set_direct_path(tree_tight, false);
}

static void touch_string(const char *s, size_t max)
{
    if (!s)
        return;
    size_t n = strlen(s);
    CHECK(n <= max);
    sink += n;
}

static void check_batch(const km_kv_batch *b, size_t max_string)
{
    CHECK(b->n_payload_events == b->n_events + b->n_rejected + b->n_unknown_events);
    CHECK((b->n_unknown_events > 0) == (b->first_unknown_type != NULL));
    if (b->first_unknown_type)
        CHECK(strlen(b->first_unknown_type) <= 63);
    CHECK(b->n_events == 0 || b->events);
    CHECK(b->n_rejected == 0 || b->rejected);
    int64_t last = -1;
    for (uint32_t i = 0; i < b->n_events; i++) {
        const km_kv_event *e = &b->events[i];
        CHECK((int64_t)e->position > last && e->position < b->n_payload_events);
        last = e->position;
        CHECK(e->kind >= KM_KV_EVENT_BLOCK_STORED && e->kind <= KM_KV_EVENT_ALL_BLOCKS_CLEARED);
        CHECK(e->medium >= KM_KV_MEDIUM_GPU && e->medium < KM_KV_MEDIUM_COUNT);
        CHECK(e->n_block_hashes == 0 || e->block_hashes);
        for (uint32_t k = 0; k < e->n_block_hashes; k++)
            sink += e->block_hashes[k];
        touch_string(e->medium_name, max_string);
        touch_string(e->lora_name, max_string);
        touch_string(e->kv_cache_spec_kind, max_string);
        touch_string(e->cache_salt, max_string);
        if (e->kind == KM_KV_EVENT_BLOCK_STORED) {
            /* block_size 0 only for a placeholder store, and only in its shape. */
            CHECK(e->placeholder == (e->block_size == 0));
            if (e->placeholder)
                CHECK(e->n_token_ids == 0 && !e->has_parent_block_hash &&
                      e->medium != KM_KV_MEDIUM_GPU && !e->sparse_blocks &&
                      e->n_lookahead_tokens == 0);
            /* Whole blocks, one per hash; or a KV-cache group's store of some blocks of a
             * longer range (sparse_blocks: more tokens, still whole blocks). */
            uint64_t blocks_tokens = (uint64_t)e->block_size * e->n_block_hashes;
            CHECK(e->sparse_blocks ? e->has_group_idx && e->n_block_hashes > 0 &&
                                         e->n_token_ids > blocks_tokens &&
                                         e->n_token_ids % e->block_size == 0
                                   : blocks_tokens == e->n_token_ids);
            CHECK(e->n_token_ids == 0 || e->token_ids);
            for (uint32_t k = 0; k < e->n_token_ids; k++)
                sink += e->token_ids[k];
            CHECK((e->extra_keys_present == NULL) == (e->extra_keys_opaque == NULL));
            if (e->extra_keys_present)
                for (uint32_t k = 0; k < e->n_block_hashes; k++) {
                    CHECK(e->extra_keys_present[k] <= 1 && e->extra_keys_opaque[k] <= 1);
                    CHECK(!e->extra_keys_opaque[k] || e->extra_keys_present[k]);
                }
            if (e->cache_salt)
                CHECK(!e->has_parent_block_hash && e->cache_salt[0]);
        } else {
            CHECK(e->token_ids == NULL && e->n_token_ids == 0 && e->extra_keys_present == NULL);
            CHECK(!e->placeholder);
            if (e->kind == KM_KV_EVENT_ALL_BLOCKS_CLEARED)
                CHECK(e->n_block_hashes == 0);
        }
    }
    last = -1;
    for (uint32_t i = 0; i < b->n_rejected; i++) {
        const km_kv_rejected_event *r = &b->rejected[i];
        CHECK((int64_t)r->position > last && r->position < b->n_payload_events);
        last = r->position;
        CHECK(r->status < 0);
        CHECK(r->message && r->message[0]);
    }
}

static bool same_string(const char *a, const char *b)
{
    return (a == NULL) == (b == NULL) && (!a || strcmp(a, b) == 0);
}

static void check_same_batch(const km_kv_batch *a, const km_kv_batch *b)
{
    CHECK(memcmp(&a->timestamp, &b->timestamp, sizeof a->timestamp) == 0);
    CHECK(a->has_data_parallel_rank == b->has_data_parallel_rank &&
          a->data_parallel_rank == b->data_parallel_rank);
    CHECK(a->n_events == b->n_events && a->n_rejected == b->n_rejected &&
          a->n_unknown_events == b->n_unknown_events && a->n_payload_events == b->n_payload_events);
    CHECK(same_string(a->first_unknown_type, b->first_unknown_type));
    for (uint32_t i = 0; i < a->n_rejected; i++)
        CHECK(a->rejected[i].position == b->rejected[i].position &&
              a->rejected[i].reason == b->rejected[i].reason &&
              strcmp(a->rejected[i].message, b->rejected[i].message) == 0);
    for (uint32_t i = 0; i < a->n_events; i++) {
        const km_kv_event *x = &a->events[i], *y = &b->events[i];
        CHECK(x->kind == y->kind && x->position == y->position && x->medium == y->medium);
        CHECK(same_string(x->medium_name, y->medium_name) && same_string(x->lora_name, y->lora_name));
        CHECK(x->has_group_idx == y->has_group_idx && x->group_idx == y->group_idx);
        CHECK(x->has_parent_block_hash == y->has_parent_block_hash &&
              x->parent_block_hash == y->parent_block_hash);
        CHECK(x->has_lora_id == y->has_lora_id && x->lora_id == y->lora_id);
        CHECK(x->n_block_hashes == y->n_block_hashes && x->n_token_ids == y->n_token_ids &&
              x->block_size == y->block_size);
        CHECK(x->n_block_hashes == 0 ||
              memcmp(x->block_hashes, y->block_hashes, 8u * x->n_block_hashes) == 0);
        CHECK(x->n_token_ids == 0 || memcmp(x->token_ids, y->token_ids, 4u * x->n_token_ids) == 0);
        CHECK((x->extra_keys_present == NULL) == (y->extra_keys_present == NULL));
        CHECK(same_string(x->cache_salt, y->cache_salt));
        CHECK(same_string(x->kv_cache_spec_kind, y->kv_cache_spec_kind));
        CHECK(x->has_kv_cache_spec_sliding_window == y->has_kv_cache_spec_sliding_window &&
              x->kv_cache_spec_sliding_window == y->kv_cache_spec_sliding_window);
        CHECK(x->n_lookahead_tokens == y->n_lookahead_tokens);
        CHECK(x->placeholder == y->placeholder && x->sparse_blocks == y->sparse_blocks);
    }
}

static bool all_zero(const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i])
            return false;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init();
    if (size < 1)
        return 0;
    uint8_t mode = data[0];
    km_kv_decoder *dec = mode & 4 ? dec_tight : dec_default;
    size_t max_string = mode & 4 ? 6 : 1024;
    data++, size--;

    km_kv_decoder_stats before, after;
    CHECK(km_kv_decoder_get_stats(dec, &before) == KM_OK);
    int rc;
    if (mode % 3 == 0) {
        uint8_t *copy = malloc(size ? size : 1);
        CHECK(copy);
        memcpy(copy, data, size);
        km_kv_batch b;
        memset(&b, 0xA5, sizeof b);
        rc = km_kv_decode_payload(dec, copy, size, &b);
        km_kv_decoder *tree = mode & 4 ? tree_tight : tree_default;
        km_kv_batch t;
        int tree_rc = km_kv_decode_payload(tree, copy, size, &t);
        free(copy);
        CHECK(rc == tree_rc);
        if (rc == KM_OK) {
            check_batch(&b, max_string);
            check_same_batch(&b, &t);
        } else {
            CHECK(all_zero(&b, sizeof b));
            CHECK(strcmp(km_kv_decoder_last_error(dec), km_kv_decoder_last_error(tree)) == 0);
        }
    } else {
        km_kv_frame frames[MAX_FRAMES];
        void *owned[MAX_FRAMES];
        size_t n = 0;
        while (size > 0 && n < MAX_FRAMES) {
            size_t len = size < 4 ? size : ((size_t)data[0] << 24 | (size_t)data[1] << 16 |
                                            (size_t)data[2] << 8 | data[3]);
            size_t skip = size < 4 ? 0 : 4;
            if (len > size - skip)
                len = size - skip;
            owned[n] = len ? malloc(len) : NULL;
            if (len)
                memcpy(owned[n], data + skip, len);
            frames[n].data = owned[n];
            frames[n].size = len;
            n++;
            data += skip + len;
            size -= skip + len;
        }
        km_kv_message m;
        memset(&m, 0xA5, sizeof m);
        km_kv_source source = mode % 3 == 1 ? KM_KV_SOURCE_SUBSCRIBER : KM_KV_SOURCE_REPLAY;
        rc = km_kv_decode_message(dec, source, frames, n, &m);
        for (size_t i = 0; i < n; i++)
            free(owned[i]);
        if (rc == KM_OK) {
            CHECK(m.kind >= KM_KV_MESSAGE_LIVE && m.kind <= KM_KV_MESSAGE_REPLAY_END);
            CHECK(m.topic != NULL);
            CHECK(m.topic_size <= max_string);
            for (uint32_t i = 0; i < m.topic_size; i++)
                sink += (unsigned char)m.topic[i];
            CHECK(m.topic[m.topic_size] == '\0');
            if (m.kind == KM_KV_MESSAGE_REPLAY_END) {
                CHECK(m.seq == KM_KV_REPLAY_END_SEQ);
                CHECK(all_zero(&m.batch, sizeof m.batch));
            } else {
                check_batch(&m.batch, max_string);
            }
        } else {
            CHECK(all_zero(&m, sizeof m));
        }
    }
    const char *err = km_kv_decoder_last_error(dec);
    CHECK(err);
    if (rc == KM_OK) {
        CHECK(err[0] == '\0');
    } else {
        CHECK(rc < 0);
        CHECK(err[0] != '\0');
    }
    CHECK(km_kv_decoder_get_stats(dec, &after) == KM_OK);
    CHECK(after.messages_decoded == before.messages_decoded + (rc == KM_OK));
    CHECK(after.messages_rejected == before.messages_rejected + (rc != KM_OK));
    return 0;
}
