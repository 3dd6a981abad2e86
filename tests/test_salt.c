/* SPDX-License-Identifier: Apache-2.0 */
/* Cache salt and other extra keys (docs/EVENTS.md, "Cache salt and other extra keys"): the decoder
 * reads each BlockStored block's extra_keys entry the way vLLM builds it (LoRA keys, multimodal
 * keys, the salt on a request's first block, prompt-embedding digests), recovers the salt, flags
 * what kvmatch cannot reproduce; the feed hashes salted chains exactly as a router hashes a
 * salted request (docs/HASHING.md) and skips opaque blocks. Payloads are packed here with
 * msgpack-c in vLLM's positional layout and decoded by the real decoder. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "test_util.h"

#define BS 4u

/* The case tables below spell out only the fields each item uses. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

/* One extra_keys item. */
typedef enum item_kind { ITEM_STR, ITEM_INT, ITEM_MM_PAIR, ITEM_BYTES, ITEM_FLOAT } item_kind;
typedef struct item {
    item_kind kind;
    const char *s; /* ITEM_STR (may hold a NUL when len says so), ITEM_MM_PAIR identifier */
    size_t len;    /* ITEM_STR: bytes of s (0 = strlen) */
    int64_t i;
} item;

/* extra_keys entry per block: n_items < 0 packs nil. */
typedef struct entry {
    int n_items;
    item items[4];
} entry;

static void pack_str(msgpack_packer *pk, const char *s, size_t len)
{
    if (!len)
        len = strlen(s);
    msgpack_pack_str(pk, len);
    msgpack_pack_str_body(pk, s, len);
}

/* ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys]
 * inside [ts, [event], rank]. */
static void pack_stored(msgpack_sbuffer *sb, const uint64_t *hashes, uint32_t n, int64_t parent,
                        const uint32_t *tokens, int64_t lora_id, const char *lora_name,
                        const entry *entries)
{
    msgpack_sbuffer_clear(sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.5);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_array(&pk, 9);
    pack_str(&pk, "BlockStored", 0);
    msgpack_pack_array(&pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(&pk, hashes[i]);
    if (parent < 0)
        msgpack_pack_nil(&pk);
    else
        msgpack_pack_uint64(&pk, (uint64_t)parent);
    msgpack_pack_array(&pk, n * BS);
    for (uint32_t i = 0; i < n * BS; i++)
        msgpack_pack_uint32(&pk, tokens[i]);
    msgpack_pack_uint32(&pk, BS);
    if (lora_id < 0)
        msgpack_pack_nil(&pk);
    else
        msgpack_pack_int64(&pk, lora_id);
    msgpack_pack_nil(&pk); /* medium: GPU */
    if (lora_name)
        pack_str(&pk, lora_name, 0);
    else
        msgpack_pack_nil(&pk);
    if (!entries) {
        msgpack_pack_nil(&pk);
    } else {
        msgpack_pack_array(&pk, n);
        for (uint32_t b = 0; b < n; b++) {
            const entry *e = &entries[b];
            if (e->n_items < 0) {
                msgpack_pack_nil(&pk);
                continue;
            }
            msgpack_pack_array(&pk, (size_t)e->n_items);
            for (int k = 0; k < e->n_items; k++) {
                const item *it = &e->items[k];
                switch (it->kind) {
                case ITEM_STR: pack_str(&pk, it->s, it->len); break;
                case ITEM_INT: msgpack_pack_int64(&pk, it->i); break;
                case ITEM_MM_PAIR:
                    msgpack_pack_array(&pk, 2);
                    pack_str(&pk, it->s, 0);
                    msgpack_pack_int64(&pk, it->i);
                    break;
                case ITEM_BYTES:
                    msgpack_pack_bin(&pk, 32);
                    msgpack_pack_bin_body(&pk, "0123456789abcdef0123456789abcdef", 32);
                    break;
                case ITEM_FLOAT: msgpack_pack_double(&pk, 0.5); break;
                }
            }
        }
    }
    msgpack_pack_int32(&pk, 0);
}

typedef struct salt_case {
    const char *name;
    int64_t parent;        /* -1: the event starts a sequence */
    int64_t lora_id;       /* -1: nil */
    const char *lora_name; /* NULL: nil */
    entry entries[3];
    const char *want_salt; /* NULL: none recovered */
    uint8_t want_opaque[3];
} salt_case;

static const salt_case cases[] = {
    {"salt on block 0", -1, -1, NULL,
     {{1, {{ITEM_STR, "tenant-42"}}}, {-1}, {0}}, "tenant-42", {0, 0, 0}},
    {"LoRA then salt", -1, -1, "adapter-a",
     {{2, {{ITEM_STR, "adapter-a"}, {ITEM_STR, "s1"}}}, {1, {{ITEM_STR, "adapter-a"}}},
      {1, {{ITEM_STR, "adapter-a"}}}},
     "s1", {0, 0, 0}},
    {"deprecated lora_id key", -1, 3, NULL,
     {{1, {{ITEM_INT, NULL, 0, 3}}}, {1, {{ITEM_INT, NULL, 0, 3}}}, {-1}}, NULL, {0, 0, 0}},
    {"multimodal pair in block 1", -1, -1, NULL,
     {{-1}, {1, {{ITEM_MM_PAIR, "img-7", 0, 2}}}, {-1}}, NULL, {0, 1, 0}},
    {"multimodal pair then salt on block 0", -1, -1, NULL,
     {{2, {{ITEM_MM_PAIR, "img-7", 0, 0}, {ITEM_STR, "s2"}}}, {-1}, {-1}}, NULL, {1, 0, 0}},
    {"prompt embeddings digest", -1, -1, NULL, {{-1}, {-1}, {1, {{ITEM_BYTES}}}}, NULL, {0, 0, 1}},
    {"two strings on block 0 (old multimodal hash + salt)", -1, -1, NULL,
     {{2, {{ITEM_STR, "mmhash"}, {ITEM_STR, "s3"}}}, {-1}, {-1}}, NULL, {1, 0, 0}},
    {"salt-like string after block 0", -1, -1, NULL, {{-1}, {1, {{ITEM_STR, "x"}}}, {-1}}, NULL,
     {0, 1, 0}},
    {"string in a continuation (has parent)", 500, -1, NULL, {{1, {{ITEM_STR, "x"}}}, {-1}, {-1}},
     NULL, {1, 0, 0}},
    {"salt with a NUL byte", -1, -1, NULL, {{1, {{ITEM_STR, "a\0b", 3}}}, {-1}, {-1}}, NULL,
     {1, 0, 0}},
    {"unknown item type", -1, -1, NULL, {{1, {{ITEM_FLOAT}}}, {-1}, {-1}}, NULL, {1, 0, 0}},
};

Test(salt, decoder_recovers_salt_and_flags_opaque_keys, .timeout = 10)
{
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    uint64_t hashes[3] = {101, 102, 103};
    uint32_t tokens[3 * BS];
    for (uint32_t i = 0; i < 3 * BS; i++)
        tokens[i] = 50 + i;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const salt_case *k = &cases[c];
        pack_stored(&sb, hashes, 3, k->parent, tokens, k->lora_id, k->lora_name, k->entries);
        km_kv_batch b;
        int rc = km_kv_decode_payload(dec, sb.data, sb.size, &b);
        cr_assert_eq(rc, KM_OK, "%s: %s", k->name, km_error_name(rc));
        cr_assert_eq(b.n_events, 1, "%s", k->name);
        const km_kv_event *e = &b.events[0];
        if (k->want_salt)
            cr_assert(e->cache_salt && strcmp(e->cache_salt, k->want_salt) == 0,
                      "%s: salt %s, want %s", k->name, e->cache_salt ? e->cache_salt : "(none)",
                      k->want_salt);
        else
            cr_assert_null(e->cache_salt, "%s: salt %s recovered", k->name, e->cache_salt);
        cr_assert_not_null(e->extra_keys_opaque, "%s", k->name);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(e->extra_keys_opaque[i], k->want_opaque[i], "%s: block %d opaque %u",
                         k->name, i, e->extra_keys_opaque[i]);
    }
    /* extra_keys nil: no flags, no salt. */
    pack_stored(&sb, hashes, 3, -1, tokens, -1, NULL, NULL);
    km_kv_batch b;
    cr_assert_eq(km_kv_decode_payload(dec, sb.data, sb.size, &b), KM_OK);
    cr_assert_null(b.events[0].extra_keys_opaque);
    cr_assert_null(b.events[0].cache_salt);
    msgpack_sbuffer_destroy(&sb);
    km_kv_decoder_destroy(dec);
}

/* Feed one payload to worker 0 at seq and flush. */
static void feed_payload(km_feed *feed, km_kv_decoder *dec, const msgpack_sbuffer *sb, uint64_t seq)
{
    km_kv_batch b;
    cr_assert_eq(km_kv_decode_payload(dec, sb->data, sb->size, &b), KM_OK);
    cr_assert_eq(km_feed_live(feed, 0, seq, &b, seq + 10), KM_OK);
    cr_assert_eq(km_feed_flush(feed, seq + 10, NULL), KM_OK);
}

Test(salt, feed_hashes_salted_chains_like_a_router, .timeout = 10)
{
    km_index *index = km_test_make_index(4);
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    km_feed *feed;
    cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_OK);
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    km_feed_worker_config wc = {0, "w0", false};
    cr_assert_eq(km_feed_add_worker(feed, &wc, 1), KM_OK);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);

    uint32_t tokens[5 * BS];
    for (uint32_t i = 0; i < 5 * BS; i++)
        tokens[i] = 900 + i;
    /* What a router computes for the salted request, and for the same tokens unsalted. */
    km_hash_config salted = {BS, NULL, "tenant-42"}, plain = {BS, NULL, NULL};
    uint64_t want[5], unsalted[5];
    size_t nb;
    cr_assert_eq(km_hash_sequence(&salted, tokens, 5 * BS, 0, KM_NO_PARENT, NULL, want, &nb), KM_OK);
    cr_assert_eq(km_hash_sequence(&plain, tokens, 5 * BS, 0, KM_NO_PARENT, NULL, unsalted, &nb),
                 KM_OK);

    /* Blocks 0..2 (salt in block 0's entry), then 3..4 continuing from engine hash 203. */
    uint64_t eh[3] = {201, 202, 203};
    entry e1[3] = {{1, {{ITEM_STR, "tenant-42"}}}, {-1}, {-1}};
    pack_stored(&sb, eh, 3, -1, tokens, -1, NULL, e1);
    feed_payload(feed, dec, &sb, 0);
    uint64_t eh2[2] = {204, 205};
    pack_stored(&sb, eh2, 2, 203, tokens + 3 * BS, -1, NULL, NULL);
    feed_payload(feed, dec, &sb, 1);
    char why[256];
    cr_assert(km_test_index_holds_exactly(index, 0, want, 5, why, sizeof why), "%s", why);
    km_request rq[2] = {{want, 5}, {unsalted, 5}};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, rq, 2, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner_depth, 5, "the salted request matches in full");
    cr_assert_eq(res.requests[1].count, 0, "the unsalted request must not match salted KV");

    /* An image in block 1 of a new sequence: block 0 is indexed, 1 and 2 are skipped, and so is
     * a continuation of block 2. */
    cr_assert_eq(km_index_clear_worker(index, 0), KM_OK);
    uint64_t eh3[3] = {301, 302, 303};
    entry e3[3] = {{-1}, {1, {{ITEM_MM_PAIR, "img-1", 0, 0}}}, {-1}};
    pack_stored(&sb, eh3, 3, -1, tokens, -1, NULL, e3);
    feed_payload(feed, dec, &sb, 2);
    uint64_t eh4[1] = {304};
    pack_stored(&sb, eh4, 1, 303, tokens + 3 * BS, -1, NULL, NULL);
    feed_payload(feed, dec, &sb, 3);
    cr_assert(km_test_index_holds_exactly(index, 0, unsalted, 1, why, sizeof why), "%s", why);
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, 0, &info), KM_OK);
    cr_assert_eq(info.counters.unhashable_blocks, 3);

    km_match_results_free(&res);
    msgpack_sbuffer_destroy(&sb);
    km_kv_decoder_destroy(dec);
    km_feed_destroy(feed);
    km_index_destroy(index);
}
