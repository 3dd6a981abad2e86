/* SPDX-License-Identifier: Apache-2.0 */
/* Test-only helpers: payload builder, simulated engine, index comparison and the ZMQ test
 * publisher (see kv_test_publisher.h). The publisher's live socket is used only by the test thread
 * that publishes; its replay ROUTER only by the publisher's own thread; the replay buffer, the log
 * and the knobs are shared under one mutex. */
#include "kv_test_publisher.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


#include "kvmatch/hash.h"
#include "kvmatch/publisher.h"

void km_test_sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

static double wall_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- payloads ---------------------------------------------------------------------------------- */

void km_test_batch_init(km_test_batch *b, km_test_encoding encoding, km_test_hash_form hash_form,
                        int64_t dp_rank)
{
    memset(b, 0, sizeof *b);
    b->encoding = encoding;
    b->hash_form = hash_form;
    b->dp_rank = dp_rank;
    msgpack_sbuffer_init(&b->events);
    msgpack_sbuffer_init(&b->payload);
}

void km_test_batch_free(km_test_batch *b)
{
    msgpack_sbuffer_destroy(&b->events);
    msgpack_sbuffer_destroy(&b->payload);
}

void km_test_batch_reset(km_test_batch *b)
{
    msgpack_sbuffer_clear(&b->events);
    b->n_events = 0;
}

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

static void pack_opt_cstr(msgpack_packer *pk, const char *s)
{
    if (s)
        pack_cstr(pk, s);
    else
        msgpack_pack_nil(pk);
}

static void pack_hash(msgpack_packer *pk, km_test_hash_form form, uint64_t h)
{
    if (form == KM_TEST_HASH_INT) {
        msgpack_pack_uint64(pk, h);
        return;
    }
    unsigned char bytes[32];
    size_t n = form == KM_TEST_HASH_BYTES32 ? 32 : 16;
    for (size_t i = 0; i < n - 8; i++)
        bytes[i] = (unsigned char)(0xA5 ^ i ^ (h >> (i % 8)));
    for (size_t i = 0; i < 8; i++)
        bytes[n - 8 + i] = (unsigned char)(h >> (56 - 8 * i));
    msgpack_pack_bin_with_body(pk, bytes, n);
}

static void pack_hashes(msgpack_packer *pk, km_test_hash_form form, const uint64_t *h, uint32_t n)
{
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        pack_hash(pk, form, h[i]);
}

/* The extra_keys entry of block i as vLLM builds it (multimodal keys, then the cache salt on a
 * request's first block), or nil when it holds nothing. */
static void pack_extra_keys_entry(msgpack_packer *pk, uint32_t i, const char *cache_salt,
                                  const char *const *images)
{
    bool image = images && images[i];
    bool salt = i == 0 && cache_salt;
    if (!image && !salt) {
        msgpack_pack_nil(pk);
        return;
    }
    msgpack_pack_array(pk, (size_t)image + (size_t)salt);
    if (image) {
        msgpack_pack_array(pk, 2); /* (identifier, offset) */
        pack_cstr(pk, images[i]);
        msgpack_pack_uint32(pk, 0);
    }
    if (salt)
        pack_cstr(pk, cache_salt);
}

static void pack_stored(km_test_batch *b, const uint64_t *hashes, uint32_t n, bool has_parent,
                        uint64_t parent, const uint32_t *tokens, uint32_t block_size,
                        const char *lora_name, const char *medium, const char *cache_salt,
                        const char *const *images)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b->events, msgpack_sbuffer_write);
    uint32_t n_tokens = n * block_size;
    bool extra_keys = cache_salt || images;
    if (b->encoding == KM_TEST_ENCODING_POSITIONAL) {
        /* Trailing defaults omitted, as msgspec's omit_defaults does. */
        uint32_t fields = extra_keys ? 9 : 6 + (medium || lora_name ? 1 : 0) + (lora_name ? 1 : 0);
        msgpack_pack_array(&pk, fields);
        pack_cstr(&pk, "BlockStored");
        pack_hashes(&pk, b->hash_form, hashes, n);
        if (has_parent)
            pack_hash(&pk, b->hash_form, parent);
        else
            msgpack_pack_nil(&pk);
        msgpack_pack_array(&pk, n_tokens);
        for (uint32_t i = 0; i < n_tokens; i++)
            msgpack_pack_uint32(&pk, tokens[i]);
        msgpack_pack_uint32(&pk, block_size);
        msgpack_pack_nil(&pk); /* lora_id */
        if (medium || lora_name || extra_keys)
            pack_opt_cstr(&pk, medium);
        if (lora_name || extra_keys)
            pack_opt_cstr(&pk, lora_name);
        if (extra_keys) {
            msgpack_pack_array(&pk, n);
            for (uint32_t i = 0; i < n; i++)
                pack_extra_keys_entry(&pk, i, cache_salt, images);
        }
    } else {
        uint32_t keys = 6 + (medium ? 1 : 0) + (lora_name ? 1 : 0) + (extra_keys ? 1 : 0);
        msgpack_pack_map(&pk, keys);
        pack_cstr(&pk, "type");
        pack_cstr(&pk, "BlockStored");
        pack_cstr(&pk, "block_hashes");
        pack_hashes(&pk, b->hash_form, hashes, n);
        pack_cstr(&pk, "parent_block_hash");
        if (has_parent)
            pack_hash(&pk, b->hash_form, parent);
        else
            msgpack_pack_nil(&pk);
        pack_cstr(&pk, "token_ids");
        msgpack_pack_array(&pk, n_tokens);
        for (uint32_t i = 0; i < n_tokens; i++)
            msgpack_pack_uint32(&pk, tokens[i]);
        pack_cstr(&pk, "block_size");
        msgpack_pack_uint32(&pk, block_size);
        pack_cstr(&pk, "lora_id");
        msgpack_pack_nil(&pk);
        if (medium) {
            pack_cstr(&pk, "medium");
            pack_cstr(&pk, medium);
        }
        if (lora_name) {
            pack_cstr(&pk, "lora_name");
            pack_cstr(&pk, lora_name);
        }
        if (extra_keys) {
            pack_cstr(&pk, "extra_keys");
            msgpack_pack_array(&pk, n);
            for (uint32_t i = 0; i < n; i++)
                pack_extra_keys_entry(&pk, i, cache_salt, images);
        }
    }
    b->n_events++;
}

void km_test_batch_stored(km_test_batch *b, const uint64_t *hashes, uint32_t n, bool has_parent,
                          uint64_t parent, const uint32_t *tokens, uint32_t block_size,
                          const char *lora_name, const char *medium)
{
    pack_stored(b, hashes, n, has_parent, parent, tokens, block_size, lora_name, medium, NULL,
                NULL);
}

void km_test_batch_stored_extra_keys(km_test_batch *b, const uint64_t *hashes, uint32_t n,
                                     bool has_parent, uint64_t parent, const uint32_t *tokens,
                                     uint32_t block_size, const char *medium,
                                     const char *cache_salt, const char *const *images)
{
    pack_stored(b, hashes, n, has_parent, parent, tokens, block_size, NULL, medium, cache_salt,
                images);
}

void km_test_batch_removed(km_test_batch *b, const uint64_t *hashes, uint32_t n,
                           const char *medium)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b->events, msgpack_sbuffer_write);
    if (b->encoding == KM_TEST_ENCODING_POSITIONAL) {
        msgpack_pack_array(&pk, medium ? 3 : 2);
        pack_cstr(&pk, "BlockRemoved");
        pack_hashes(&pk, b->hash_form, hashes, n);
        if (medium)
            pack_cstr(&pk, medium);
    } else {
        msgpack_pack_map(&pk, 3);
        pack_cstr(&pk, "type");
        pack_cstr(&pk, "BlockRemoved");
        pack_cstr(&pk, "block_hashes");
        pack_hashes(&pk, b->hash_form, hashes, n);
        pack_cstr(&pk, "medium");
        pack_opt_cstr(&pk, medium);
    }
    b->n_events++;
}

void km_test_batch_cleared(km_test_batch *b)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b->events, msgpack_sbuffer_write);
    if (b->encoding == KM_TEST_ENCODING_POSITIONAL) {
        msgpack_pack_array(&pk, 1);
    } else {
        msgpack_pack_map(&pk, 1);
        pack_cstr(&pk, "type");
    }
    pack_cstr(&pk, "AllBlocksCleared");
    b->n_events++;
}

const void *km_test_batch_payload(km_test_batch *b, size_t *size)
{
    msgpack_sbuffer_clear(&b->payload);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b->payload, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, b->dp_rank >= 0 ? 3 : 2);
    b->timestamp = wall_seconds();
    msgpack_pack_double(&pk, b->timestamp);
    msgpack_pack_array(&pk, b->n_events);
    msgpack_sbuffer_write(&b->payload, b->events.data, b->events.size);
    if (b->dp_rank >= 0)
        msgpack_pack_int64(&pk, b->dp_rank);
    *size = b->payload.size;
    return b->payload.data;
}

/* ---- the simulated engine ----------------------------------------------------------------------- */

void km_test_engine_init(km_test_engine *e, uint32_t block_size, uint64_t process_seed)
{
    memset(e, 0, sizeof *e);
    e->block_size = block_size;
    e->process_seed = process_seed;
}

void km_test_engine_free(km_test_engine *e)
{
    for (size_t i = 0; i < e->n_blocks; i++)
        free(e->blocks[i].tokens);
    free(e->blocks);
    memset(e, 0, sizeof *e);
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* Engine hash of block i: depends on the process seed and the block's identity, as vLLM's depends
 * on NONE_HASH and the content. Values above 2^63 occur. */
static uint64_t engine_hash_of(const km_test_engine *e, size_t i)
{
    return mix64(e->process_seed * UINT64_C(0x9E3779B97F4A7C15) + e->blocks[i].chain);
}

static size_t engine_new_block(km_test_engine *e, km_rng *r, int64_t parent)
{
    if (e->n_blocks == e->capacity) {
        e->capacity = e->capacity ? e->capacity * 2 : 64;
        e->blocks = realloc(e->blocks, e->capacity * sizeof *e->blocks);
        cr_assert(e->blocks != NULL);
    }
    km_test_block *blk = &e->blocks[e->n_blocks];
    memset(blk, 0, sizeof *blk);
    blk->parent = parent;
    blk->tokens = malloc(e->block_size * sizeof *blk->tokens);
    cr_assert(blk->tokens != NULL);
    for (uint32_t t = 0; t < e->block_size; t++)
        blk->tokens[t] = (uint32_t)km_rng_next(r);
    km_hash_config hc = {e->block_size, e->lora_name, NULL};
    uint64_t parent_chain = parent >= 0 ? e->blocks[parent].chain : 0;
    size_t nb = 0;
    cr_assert_eq(km_hash_sequence(&hc, blk->tokens, e->block_size, parent >= 0 ? 1 : 0,
                                  parent_chain, NULL, &blk->chain, &nb),
                 KM_OK);
    e->n_blocks++;
    blk->engine_hash = engine_hash_of(e, e->n_blocks - 1);
    return e->n_blocks - 1;
}

/* Emit a BlockStored for blocks idx[0..n) (a run: idx[i+1]'s parent is idx[i]). */
static void emit_store(km_test_engine *e, km_test_batch *b, const size_t *idx, uint32_t n)
{
    uint64_t *hashes = malloc(n * sizeof *hashes);
    uint32_t *tokens = malloc((size_t)n * e->block_size * sizeof *tokens);
    cr_assert(hashes && tokens);
    for (uint32_t i = 0; i < n; i++) {
        hashes[i] = e->blocks[idx[i]].engine_hash;
        memcpy(tokens + (size_t)i * e->block_size, e->blocks[idx[i]].tokens,
               e->block_size * sizeof *tokens);
        e->blocks[idx[i]].cached = true;
    }
    int64_t parent = e->blocks[idx[0]].parent;
    km_test_batch_stored(b, hashes, n, parent >= 0, parent >= 0 ? e->blocks[parent].engine_hash : 0,
                         tokens, e->block_size, e->lora_name, e->medium);
    free(hashes);
    free(tokens);
}

size_t km_test_engine_store(km_test_engine *e, km_rng *r, km_test_batch *b, int64_t parent,
                            uint32_t n)
{
    size_t idx[64];
    cr_assert(n >= 1 && n <= 64);
    int64_t p = parent;
    for (uint32_t i = 0; i < n; i++) {
        idx[i] = engine_new_block(e, r, p);
        p = (int64_t)idx[i];
    }
    emit_store(e, b, idx, n);
    return idx[0];
}

static size_t pick_cached(const km_test_engine *e, km_rng *r, size_t n_cached)
{
    uint32_t k = km_rng_below(r, (uint32_t)n_cached);
    for (size_t i = 0; i < e->n_blocks; i++)
        if (e->blocks[i].cached && k-- == 0)
            return i;
    return 0;
}

void km_test_engine_step(km_test_engine *e, km_rng *r, km_test_batch *b, uint32_t max_events,
                         uint32_t clear_percent)
{
    uint32_t n_events = 1 + km_rng_below(r, max_events);
    for (uint32_t ev = 0; ev < n_events; ev++) {
        size_t n_cached = 0;
        for (size_t i = 0; i < e->n_blocks; i++)
            n_cached += e->blocks[i].cached;
        uint32_t roll = km_rng_below(r, 100);
        if (roll < clear_percent) {
            km_test_batch_cleared(b);
            for (size_t i = 0; i < e->n_blocks; i++)
                e->blocks[i].cached = false;
        } else if (roll < 60 || n_cached == 0) {
            /* Re-store an evicted block whose parent is cached (same engine hash), or store new
             * blocks continuing a cached block or starting a sequence. */
            if (km_rng_percent(r, 15)) {
                for (size_t tries = 0; tries < 8 && e->n_blocks; tries++) {
                    size_t i = km_rng_below(r, (uint32_t)e->n_blocks);
                    km_test_block *blk = &e->blocks[i];
                    if (!blk->cached && (blk->parent < 0 || e->blocks[blk->parent].cached)) {
                        emit_store(e, b, &i, 1);
                        break;
                    }
                }
                continue;
            }
            int64_t parent = n_cached && km_rng_percent(r, 70) ? (int64_t)pick_cached(e, r, n_cached)
                                                                : -1;
            km_test_engine_store(e, r, b, parent, 1 + km_rng_below(r, 4));
        } else {
            uint32_t k = 1 + km_rng_below(r, 3);
            uint64_t hashes[3];
            uint32_t n = 0;
            for (uint32_t j = 0; j < k && n_cached; j++) {
                size_t i = pick_cached(e, r, n_cached);
                hashes[n++] = e->blocks[i].engine_hash;
                e->blocks[i].cached = false;
                n_cached--;
            }
            km_test_batch_removed(b, hashes, n, e->medium);
        }
    }
}

void km_test_engine_restart(km_test_engine *e, uint64_t process_seed)
{
    e->process_seed = process_seed;
    for (size_t i = 0; i < e->n_blocks; i++) {
        e->blocks[i].cached = false;
        e->blocks[i].engine_hash = engine_hash_of(e, i);
    }
}

uint64_t *km_test_engine_chains(const km_test_engine *e, bool all, size_t *n_out)
{
    uint64_t *out = malloc((e->n_blocks + 1) * sizeof *out);
    cr_assert(out != NULL);
    size_t n = 0;
    for (size_t i = 0; i < e->n_blocks; i++)
        if (all || e->blocks[i].cached)
            out[n++] = e->blocks[i].chain;
    *n_out = n;
    return out;
}

/* ---- index comparison ---------------------------------------------------------------------------- */

static int holds(const km_index *index, uint32_t w, uint64_t hash)
{
    uint32_t workers[64], n = 0;
    cr_assert_eq(km_index_holders(index, hash, workers, 64, &n), KM_OK);
    for (uint32_t i = 0; i < n && i < 64; i++)
        if (workers[i] == w)
            return 1;
    return 0;
}

int km_test_index_same(const km_index *a, uint32_t wa, const km_index *b, uint32_t wb,
                       const uint64_t *universe, size_t n, char *why, size_t why_size)
{
    km_worker_stats sa, sb;
    cr_assert_eq(km_index_worker_stats(a, wa, &sa), KM_OK);
    cr_assert_eq(km_index_worker_stats(b, wb, &sb), KM_OK);
    if (sa.blocks != sb.blocks) {
        snprintf(why, why_size, "worker %u holds %" PRIu64 " blocks, reference %u holds %" PRIu64,
                 wa, sa.blocks, wb, sb.blocks);
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        int ha = holds(a, wa, universe[i]), hb = holds(b, wb, universe[i]);
        if (ha != hb) {
            snprintf(why, why_size, "chain %016" PRIx64 ": held %d, reference %d", universe[i], ha,
                     hb);
            return 0;
        }
    }
    return 1;
}

int km_test_index_holds_exactly(const km_index *index, uint32_t w, const uint64_t *chains, size_t n,
                                char *why, size_t why_size)
{
    km_worker_stats ws;
    cr_assert_eq(km_index_worker_stats(index, w, &ws), KM_OK);
    /* chains may repeat (equal content stored twice); count distinct ones */
    size_t distinct = 0;
    for (size_t i = 0; i < n; i++) {
        size_t j = 0;
        while (j < i && chains[j] != chains[i])
            j++;
        distinct += j == i;
        if (!holds(index, w, chains[i])) {
            snprintf(why, why_size, "worker %u lacks chain %016" PRIx64, w, chains[i]);
            return 0;
        }
    }
    if (ws.blocks != distinct) {
        snprintf(why, why_size, "worker %u holds %" PRIu64 " blocks, expected %zu", w, ws.blocks,
                 distinct);
        return 0;
    }
    return 1;
}

static void quiet_log(void *user, const char *line)
{
    (void)user;
    (void)line;
}

km_index *km_test_make_index(uint32_t max_workers)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = max_workers;
    cfg.threads = 2;
    cfg.initial_blocks = 1024;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    return index;
}

void km_test_feed_config(km_feed_config *cfg, uint32_t block_size)
{
    km_feed_config_init(cfg);
    cfg->block_size = block_size;
    cfg->log = getenv("KM_TEST_FEED_LOG") ? NULL : quiet_log;
}

/* ---- the publisher: the library's km_publisher (include/kvmatch/publisher.h) -------------------------- */

struct km_test_publisher {
    km_publisher *pub;
    uint16_t port, replay_port;
};

void km_test_publisher_config_init(km_test_publisher_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->replay = true;
    cfg->buffer_steps = 10000;
    cfg->replay_form = KM_TEST_REPLAY_WITH_TOPIC;
}

static uint16_t port_of(const char *endpoint)
{
    const char *colon = endpoint ? strrchr(endpoint, ':') : NULL;
    return colon ? (uint16_t)atoi(colon + 1) : 0;
}

int km_test_publisher_start(const km_test_publisher_config *cfg_in, km_test_publisher **out)
{
    *out = NULL;
    km_test_publisher_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        km_test_publisher_config_init(&cfg);
    char endpoint[64], replay[64];
    if (cfg.port)
        snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%u", cfg.port);
    else
        snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:*");
    if (cfg.replay_port)
        snprintf(replay, sizeof replay, "tcp://127.0.0.1:%u", cfg.replay_port);
    else
        snprintf(replay, sizeof replay, "tcp://127.0.0.1:*");
    km_publisher_config pc;
    km_publisher_config_init(&pc);
    pc.endpoint = endpoint;
    pc.replay_endpoint = replay;
    pc.replay = cfg.replay;
    pc.topic = cfg.topic;
    pc.buffer_steps = cfg.buffer_steps ? cfg.buffer_steps : 10000;
    pc.replay_form = cfg.replay_form == KM_TEST_REPLAY_NO_TOPIC ? KM_REPLAY_NO_TOPIC
                                                                : KM_REPLAY_WITH_TOPIC;
    pc.keep_log = true;
    km_test_publisher *t = calloc(1, sizeof *t);
    cr_assert_not_null(t);
    char why[256];
    int rc = km_publisher_start(&pc, &t->pub, why, sizeof why);
    if (rc != KM_OK) {
        free(t);
        return rc;
    }
    t->port = port_of(km_publisher_endpoint(t->pub));
    t->replay_port = port_of(km_publisher_replay_endpoint(t->pub));
    *out = t;
    return KM_OK;
}

void km_test_publisher_stop(km_test_publisher *p)
{
    if (!p)
        return;
    km_publisher_stop(p->pub);
    free(p);
}

const char *km_test_publisher_endpoint(const km_test_publisher *p)
{
    return km_publisher_endpoint(p->pub);
}

const char *km_test_publisher_replay_endpoint(const km_test_publisher *p)
{
    return km_publisher_replay_endpoint(p->pub);
}

uint16_t km_test_publisher_port(const km_test_publisher *p)
{
    return p->port;
}

uint16_t km_test_publisher_replay_port(const km_test_publisher *p)
{
    return p->replay_port;
}

uint64_t km_test_publisher_publish(km_test_publisher *p, const void *payload, size_t size)
{
    uint64_t seq = 0;
    int rc = km_publisher_publish(p->pub, payload, size, &seq);
    cr_assert_eq(rc, KM_OK, "publish: %s", km_error_name(rc));
    return seq;
}

uint64_t km_test_publisher_publish_batch(km_test_publisher *p, km_test_batch *b)
{
    size_t size;
    const void *payload = km_test_batch_payload(b, &size);
    return km_test_publisher_publish(p, payload, size);
}

void km_test_publisher_drop_live(km_test_publisher *p, bool drop)
{
    km_publisher_drop_live(p->pub, drop);
}

void km_test_publisher_restart(km_test_publisher *p)
{
    km_publisher_restart(p->pub);
}

void km_test_publisher_evict(km_test_publisher *p, uint32_t keep)
{
    km_publisher_evict(p->pub, keep);
}

void km_test_publisher_hold_replay(km_test_publisher *p, bool hold)
{
    km_publisher_hold_replay(p->pub, hold);
}

void km_test_publisher_mute_replay(km_test_publisher *p, bool mute)
{
    km_publisher_mute_replay(p->pub, mute);
}

void km_test_publisher_replay_delay_us(km_test_publisher *p, uint32_t us)
{
    km_publisher_replay_delay_us(p->pub, us);
}

void km_test_publisher_drop_replay_items(km_test_publisher *p, uint32_t after, uint32_t count)
{
    km_publisher_drop_replay_items(p->pub, after, count);
}

uint64_t km_test_publisher_replay_requests(km_test_publisher *p)
{
    return km_publisher_replay_requests(p->pub);
}

uint64_t km_test_publisher_next_seq(km_test_publisher *p)
{
    return km_publisher_next_seq(p->pub);
}

int km_test_publisher_send_frames(km_test_publisher *p, const km_kv_frame *frames, size_t n)
{
    return km_publisher_send_frames(p->pub, frames, n) == KM_OK ? 0 : -1;
}

bool km_test_publisher_wait_subscribers(km_test_publisher *p, uint32_t n, int timeout_ms)
{
    return km_publisher_wait_subscribers(p->pub, n, timeout_ms);
}

size_t km_test_publisher_log_count(km_test_publisher *p)
{
    return km_publisher_log_count(p->pub);
}

const void *km_test_publisher_log_entry(km_test_publisher *p, size_t i, uint64_t *seq, size_t *size)
{
    const void *d = km_publisher_log_entry(p->pub, i, seq, size);
    cr_assert_not_null(d, "log entry %zu", i);
    return d;
}

km_index *km_test_reference_index(km_test_publisher *p, uint32_t max_workers, uint32_t worker,
                                  const km_feed_config *cfg_in)
{
    km_index *index = km_test_make_index(max_workers);
    km_feed_config cfg = *cfg_in;
    cfg.bootstrap_replay = false;
    km_feed *feed = NULL;
    cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_OK);
    km_feed_worker_config wc = {worker, "reference", false};
    cr_assert_eq(km_feed_add_worker(feed, &wc, 1), KM_OK);
    km_kv_decoder *dec = NULL;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    size_t n = km_test_publisher_log_count(p);
    for (size_t i = 0; i < n; i++) {
        uint64_t seq;
        size_t size;
        const void *payload = km_test_publisher_log_entry(p, i, &seq, &size);
        km_kv_batch batch;
        int rc = km_kv_decode_payload(dec, payload, size, &batch);
        cr_assert_eq(km_feed_live(feed, worker, seq, rc == KM_OK ? &batch : NULL, 2 + i), KM_OK);
    }
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, worker, &info), KM_OK);
    cr_assert_eq(info.counters.gaps, 0, "the reference run has a gap");
    cr_assert_eq(km_feed_flush(feed, 2 + n, NULL), KM_OK);
    km_feed_destroy(feed);
    km_kv_decoder_destroy(dec);
    return index;
}
