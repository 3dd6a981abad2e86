/* Test-only helpers: payload builder, simulated engine, index comparison and the ZMQ test
 * publisher (see kv_test_publisher.h). The publisher's live socket is used only by the test thread
 * that publishes; its replay ROUTER only by the publisher's own thread; the replay buffer, the log
 * and the knobs are shared under one mutex. */
#include "kv_test_publisher.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "kvmatch/hash.h"

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

void km_test_batch_stored(km_test_batch *b, const uint64_t *hashes, uint32_t n, bool has_parent,
                          uint64_t parent, const uint32_t *tokens, uint32_t block_size,
                          const char *lora_name, const char *medium)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b->events, msgpack_sbuffer_write);
    uint32_t n_tokens = n * block_size;
    if (b->encoding == KM_TEST_ENCODING_POSITIONAL) {
        /* Trailing defaults omitted, as msgspec's omit_defaults does. */
        uint32_t fields = 6 + (medium || lora_name ? 1 : 0) + (lora_name ? 1 : 0);
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
        if (medium || lora_name)
            pack_opt_cstr(&pk, medium);
        if (lora_name)
            pack_cstr(&pk, lora_name);
    } else {
        uint32_t keys = 6 + (medium ? 1 : 0) + (lora_name ? 1 : 0);
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
    }
    b->n_events++;
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

/* ---- the publisher ---------------------------------------------------------------------------------- */

typedef struct buffered {
    uint64_t seq;
    void *payload;
    size_t size;
} buffered;

typedef struct pending_request {
    unsigned char identity[256];
    size_t identity_size;
    uint64_t start;
} pending_request;

struct km_test_publisher {
    km_test_publisher_config config;
    char topic[256];
    void *ctx;
    void *pub;    /* XPUB: test thread only */
    void *router; /* publisher thread only */
    void *stop_recv, *stop_send; /* inproc PAIR to wake the thread */
    char endpoint[64], replay_endpoint[64];
    uint16_t port, replay_port;
    pthread_t thread;
    bool thread_started;
    uint32_t subscriptions; /* seen on the XPUB (test thread) */

    pthread_mutex_t lock; /* everything below */
    uint64_t next_seq;
    buffered *ring; /* buffer_steps entries */
    uint32_t ring_head, ring_count;
    buffered *log;
    size_t log_count, log_capacity;
    bool drop_live, hold, mute;
    uint32_t delay_us;
    uint64_t replay_requests;
    pending_request *pending;
    size_t pending_count, pending_capacity;
};

void km_test_publisher_config_init(km_test_publisher_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->replay = true;
    cfg->buffer_steps = 10000;
    cfg->replay_form = KM_TEST_REPLAY_WITH_TOPIC;
}

static void be64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (56 - 8 * i));
}

static int send_parts(void *sock, const km_kv_frame *frames, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (zmq_send(sock, frames[i].data, frames[i].size, i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
            return -1;
    return 0;
}

/* Answer one replay request like vLLM's _service_replay: every buffered message with
 * seq >= start, then the end marker. The buffer is copied first so publishing is not blocked. */
static void serve_replay(km_test_publisher *p, const pending_request *req)
{
    pthread_mutex_lock(&p->lock);
    uint32_t n = 0;
    buffered *copy = malloc(((size_t)p->ring_count + 1) * sizeof *copy);
    for (uint32_t i = 0; copy && i < p->ring_count; i++) {
        const buffered *b = &p->ring[(p->ring_head + i) % p->config.buffer_steps];
        if (b->seq < req->start)
            continue;
        copy[n].seq = b->seq;
        copy[n].size = b->size;
        copy[n].payload = malloc(b->size ? b->size : 1);
        memcpy(copy[n].payload, b->payload, b->size);
        n++;
    }
    uint32_t delay = p->delay_us;
    pthread_mutex_unlock(&p->lock);
    bool with_topic = p->config.replay_form == KM_TEST_REPLAY_WITH_TOPIC;
    for (uint32_t i = 0; i < n; i++) {
        unsigned char seq[8];
        be64(seq, copy[i].seq);
        km_kv_frame f[5] = {{req->identity, req->identity_size}, {NULL, 0}};
        size_t k = 2;
        if (with_topic)
            f[k++] = (km_kv_frame){p->topic, strlen(p->topic)};
        f[k++] = (km_kv_frame){seq, 8};
        f[k++] = (km_kv_frame){copy[i].payload, copy[i].size};
        send_parts(p->router, f, k);
        free(copy[i].payload);
        if (delay) {
            struct timespec ts = {0, (long)delay * 1000L};
            nanosleep(&ts, NULL);
        }
    }
    free(copy);
    unsigned char end[8];
    memset(end, 0xFF, 8);
    km_kv_frame f[5] = {{req->identity, req->identity_size}, {NULL, 0}};
    size_t k = 2;
    if (with_topic)
        f[k++] = (km_kv_frame){NULL, 0};
    f[k++] = (km_kv_frame){end, 8};
    f[k++] = (km_kv_frame){NULL, 0};
    send_parts(p->router, f, k);
}

static void *publisher_thread(void *arg)
{
    km_test_publisher *p = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{p->router, 0, ZMQ_POLLIN, 0}, {p->stop_recv, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(items, 2, 5);
        if (rc < 0 && errno != EINTR)
            break;
        if (items[1].revents & ZMQ_POLLIN) {
            char c;
            zmq_recv(p->stop_recv, &c, 1, 0);
            if (c == 'q')
                break;
        }
        if (items[0].revents & ZMQ_POLLIN) {
            /* [identity, empty, start_seq]: anything else is ignored, as vLLM does. */
            zmq_msg_t parts[4];
            int n = 0, more = 1;
            while (more) {
                zmq_msg_t m;
                zmq_msg_init(&m);
                if (zmq_msg_recv(&m, p->router, 0) < 0) {
                    zmq_msg_close(&m);
                    break;
                }
                more = zmq_msg_more(&m);
                if (n < 4)
                    parts[n++] = m;
                else
                    zmq_msg_close(&m);
            }
            if (n == 3 && zmq_msg_size(&parts[1]) == 0 && zmq_msg_size(&parts[0]) <= 256 &&
                zmq_msg_size(&parts[2]) >= 1 && zmq_msg_size(&parts[2]) <= 8) {
                pending_request req;
                req.identity_size = zmq_msg_size(&parts[0]);
                memcpy(req.identity, zmq_msg_data(&parts[0]), req.identity_size);
                req.start = 0;
                const unsigned char *s = zmq_msg_data(&parts[2]);
                for (size_t i = 0; i < zmq_msg_size(&parts[2]); i++)
                    req.start = req.start << 8 | s[i];
                pthread_mutex_lock(&p->lock);
                p->replay_requests++;
                bool drop = p->mute;
                if (!drop) {
                    if (p->pending_count == p->pending_capacity) {
                        p->pending_capacity = p->pending_capacity ? p->pending_capacity * 2 : 8;
                        p->pending = realloc(p->pending, p->pending_capacity * sizeof *p->pending);
                    }
                    p->pending[p->pending_count++] = req;
                }
                pthread_mutex_unlock(&p->lock);
            }
            for (int i = 0; i < n; i++)
                zmq_msg_close(&parts[i]);
        }
        /* Serve what is pending unless held. */
        for (;;) {
            pthread_mutex_lock(&p->lock);
            if (p->hold || p->pending_count == 0) {
                pthread_mutex_unlock(&p->lock);
                break;
            }
            pending_request req = p->pending[0];
            memmove(p->pending, p->pending + 1, (p->pending_count - 1) * sizeof *p->pending);
            p->pending_count--;
            pthread_mutex_unlock(&p->lock);
            serve_replay(p, &req);
        }
    }
    return NULL;
}

static int bind_tcp(void *sock, uint16_t port, char *endpoint, size_t size, uint16_t *port_out)
{
    char addr[64];
    if (port)
        snprintf(addr, sizeof addr, "tcp://127.0.0.1:%u", port);
    else
        snprintf(addr, sizeof addr, "tcp://127.0.0.1:*");
    if (zmq_bind(sock, addr) != 0)
        return -1;
    size_t len = size;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, endpoint, &len) != 0)
        return -1;
    const char *colon = strrchr(endpoint, ':');
    *port_out = colon ? (uint16_t)atoi(colon + 1) : 0;
    return 0;
}

int km_test_publisher_start(const km_test_publisher_config *cfg_in, km_test_publisher **out)
{
    *out = NULL;
    km_test_publisher *p = calloc(1, sizeof *p);
    cr_assert(p != NULL);
    if (cfg_in)
        p->config = *cfg_in;
    else
        km_test_publisher_config_init(&p->config);
    if (p->config.buffer_steps == 0)
        p->config.buffer_steps = 10000;
    snprintf(p->topic, sizeof p->topic, "%s", p->config.topic ? p->config.topic : "");
    pthread_mutex_init(&p->lock, NULL);
    p->ring = calloc(p->config.buffer_steps, sizeof *p->ring);
    p->ctx = zmq_ctx_new();
    p->pub = zmq_socket(p->ctx, ZMQ_XPUB);
    int one = 1, zero = 0, hwm = 100000;
    zmq_setsockopt(p->pub, ZMQ_XPUB_VERBOSE, &one, sizeof one);
    zmq_setsockopt(p->pub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(p->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    if (bind_tcp(p->pub, p->config.port, p->endpoint, sizeof p->endpoint, &p->port) != 0)
        goto fail;
    if (p->config.replay) {
        p->router = zmq_socket(p->ctx, ZMQ_ROUTER);
        zmq_setsockopt(p->router, ZMQ_LINGER, &zero, sizeof zero);
        if (bind_tcp(p->router, p->config.replay_port, p->replay_endpoint,
                     sizeof p->replay_endpoint, &p->replay_port) != 0)
            goto fail;
    } else {
        /* A ROUTER nobody connects to keeps the thread loop uniform. */
        p->router = zmq_socket(p->ctx, ZMQ_ROUTER);
        zmq_setsockopt(p->router, ZMQ_LINGER, &zero, sizeof zero);
    }
    char inproc[64];
    snprintf(inproc, sizeof inproc, "inproc://km-test-publisher-%p", (void *)p);
    p->stop_recv = zmq_socket(p->ctx, ZMQ_PAIR);
    p->stop_send = zmq_socket(p->ctx, ZMQ_PAIR);
    zmq_setsockopt(p->stop_recv, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(p->stop_send, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_bind(p->stop_recv, inproc), 0);
    cr_assert_eq(zmq_connect(p->stop_send, inproc), 0);
    cr_assert_eq(pthread_create(&p->thread, NULL, publisher_thread, p), 0);
    p->thread_started = true;
    *out = p;
    return KM_OK;
fail:
    km_test_publisher_stop(p);
    return KM_ERR_IO;
}

void km_test_publisher_stop(km_test_publisher *p)
{
    if (!p)
        return;
    if (p->thread_started) {
        zmq_send(p->stop_send, "q", 1, 0);
        pthread_join(p->thread, NULL);
    }
    if (p->stop_send)
        zmq_close(p->stop_send);
    if (p->stop_recv)
        zmq_close(p->stop_recv);
    if (p->router)
        zmq_close(p->router);
    if (p->pub)
        zmq_close(p->pub);
    if (p->ctx)
        zmq_ctx_term(p->ctx);
    for (uint32_t i = 0; i < p->ring_count; i++)
        free(p->ring[(p->ring_head + i) % p->config.buffer_steps].payload);
    free(p->ring);
    for (size_t i = 0; i < p->log_count; i++)
        free(p->log[i].payload);
    free(p->log);
    free(p->pending);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

const char *km_test_publisher_endpoint(const km_test_publisher *p)
{
    return p->endpoint;
}

const char *km_test_publisher_replay_endpoint(const km_test_publisher *p)
{
    return p->config.replay ? p->replay_endpoint : NULL;
}

uint16_t km_test_publisher_port(const km_test_publisher *p)
{
    return p->port;
}

uint16_t km_test_publisher_replay_port(const km_test_publisher *p)
{
    return p->replay_port;
}

static void *dup_bytes(const void *src, size_t n)
{
    void *d = malloc(n ? n : 1);
    cr_assert(d != NULL);
    if (n)
        memcpy(d, src, n);
    return d;
}

uint64_t km_test_publisher_publish(km_test_publisher *p, const void *payload, size_t size)
{
    pthread_mutex_lock(&p->lock);
    uint64_t seq = p->next_seq++;
    uint32_t steps = p->config.buffer_steps;
    if (p->ring_count == steps) {
        free(p->ring[p->ring_head].payload);
        p->ring_head = (p->ring_head + 1) % steps;
        p->ring_count--;
    }
    p->ring[(p->ring_head + p->ring_count) % steps] = (buffered){seq, dup_bytes(payload, size), size};
    p->ring_count++;
    if (p->log_count == p->log_capacity) {
        p->log_capacity = p->log_capacity ? p->log_capacity * 2 : 64;
        p->log = realloc(p->log, p->log_capacity * sizeof *p->log);
        cr_assert(p->log != NULL);
    }
    p->log[p->log_count++] = (buffered){seq, dup_bytes(payload, size), size};
    bool drop = p->drop_live;
    pthread_mutex_unlock(&p->lock);
    if (!drop) {
        unsigned char s[8];
        be64(s, seq);
        km_kv_frame f[3] = {{p->topic, strlen(p->topic)}, {s, 8}, {payload, size}};
        cr_assert_eq(send_parts(p->pub, f, 3), 0, "publish: %s", zmq_strerror(errno));
    }
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
    pthread_mutex_lock(&p->lock);
    p->drop_live = drop;
    pthread_mutex_unlock(&p->lock);
}

void km_test_publisher_restart(km_test_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    p->next_seq = 0;
    for (uint32_t i = 0; i < p->ring_count; i++)
        free(p->ring[(p->ring_head + i) % p->config.buffer_steps].payload);
    p->ring_head = p->ring_count = 0;
    pthread_mutex_unlock(&p->lock);
}

void km_test_publisher_evict(km_test_publisher *p, uint32_t keep)
{
    pthread_mutex_lock(&p->lock);
    while (p->ring_count > keep) {
        free(p->ring[p->ring_head].payload);
        p->ring_head = (p->ring_head + 1) % p->config.buffer_steps;
        p->ring_count--;
    }
    pthread_mutex_unlock(&p->lock);
}

void km_test_publisher_hold_replay(km_test_publisher *p, bool hold)
{
    pthread_mutex_lock(&p->lock);
    p->hold = hold;
    pthread_mutex_unlock(&p->lock);
}

void km_test_publisher_mute_replay(km_test_publisher *p, bool mute)
{
    pthread_mutex_lock(&p->lock);
    p->mute = mute;
    pthread_mutex_unlock(&p->lock);
}

void km_test_publisher_replay_delay_us(km_test_publisher *p, uint32_t us)
{
    pthread_mutex_lock(&p->lock);
    p->delay_us = us;
    pthread_mutex_unlock(&p->lock);
}

uint64_t km_test_publisher_replay_requests(km_test_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    uint64_t n = p->replay_requests;
    pthread_mutex_unlock(&p->lock);
    return n;
}

uint64_t km_test_publisher_next_seq(km_test_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    uint64_t n = p->next_seq;
    pthread_mutex_unlock(&p->lock);
    return n;
}

int km_test_publisher_send_frames(km_test_publisher *p, const km_kv_frame *frames, size_t n)
{
    return send_parts(p->pub, frames, n);
}

bool km_test_publisher_wait_subscribers(km_test_publisher *p, uint32_t n, int timeout_ms)
{
    double deadline = km_test_now() + timeout_ms / 1000.0;
    while (p->subscriptions < n) {
        double left = deadline - km_test_now();
        if (left <= 0)
            return false;
        zmq_pollitem_t item = {p->pub, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, (long)(left * 1000) + 1) <= 0)
            continue;
        unsigned char buf[256];
        int got = zmq_recv(p->pub, buf, sizeof buf, ZMQ_DONTWAIT);
        if (got >= 1 && buf[0] == 1)
            p->subscriptions++;
    }
    return true;
}

size_t km_test_publisher_log_count(km_test_publisher *p)
{
    pthread_mutex_lock(&p->lock);
    size_t n = p->log_count;
    pthread_mutex_unlock(&p->lock);
    return n;
}

const void *km_test_publisher_log_entry(km_test_publisher *p, size_t i, uint64_t *seq, size_t *size)
{
    pthread_mutex_lock(&p->lock);
    cr_assert(i < p->log_count);
    const buffered *b = &p->log[i];
    *seq = b->seq;
    *size = b->size;
    const void *data = b->payload;
    pthread_mutex_unlock(&p->lock);
    return data;
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
