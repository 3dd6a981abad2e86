/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch bench events [--json] [--quick] [--trace PATH]`: KV-event ingestion and restart.
 *
 * Workload (generated once, before any timing): the Mooncake conversation trace, each request sent
 * round-robin to one of 16 workers (requests that store nothing new do not advance it), 16-token
 * blocks, 512 tokens per trace id (km_trace_id_tokens). Each worker runs an LRU prefix cache of
 * WORKER_CAPACITY blocks: a request touches its cached prefix and stores the rest as one
 * BlockStored (token ids, engine hashes = splitmix64 of the block's key and the worker, parent =
 * the previous block's engine hash), evicting least-recently-used blocks first as one BlockRemoved
 * in the same message. Every message is pre-encoded with msgpack-c in vLLM's positional form.
 *
 *  - inproc: km_kv_decode_message + km_feed_live + km_feed_flush every FLUSH_EVERY messages,
 *    timed end to end on one thread.
 *  - zmq: one XPUB per worker on tcp://127.0.0.1 in a publisher thread (ZMQ_SNDHWM 0 = no drop),
 *    the real km_subscriber (receive_hwm 0) on its I/O thread, the main thread flushing every
 *    millisecond; timed from the first send until every message was received and applied. Any
 *    drop shows as lost seqs and is reported.
 *  - restart: an index with ~10 M (block, worker) pairs built through the feed (synthetic
 *    batches, not the trace: the trace's LRU steady state is far smaller), saved with
 *    km_feed_save; timed: create index + feed, km_feed_restore, claim every worker (ready: the
 *    state is restored and every worker resumes).
 * Block events = stored blocks + removed blocks. Medians over reps. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_common.h"
#include "bench_lru.h"
#include "cli/commands.h"
#include "sim/trace.h"
#include "kvmatch/feed.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"
#include "kvmatch/subscriber.h"

#define EV_WORKERS 16u
#define EV_BLOCK_SIZE 16u
#define EV_TOKENS_PER_ID 512u
#define EV_BLOCKS_PER_ID (EV_TOKENS_PER_ID / EV_BLOCK_SIZE)
#define WORKER_CAPACITY 65536u /* blocks per worker (an 80 GB-class GPU at 16-token blocks) */
#define FLUSH_EVERY 64u

static uint64_t splitmix64(uint64_t x)
{
    x += UINT64_C(0x9E3779B97F4A7C15);
    x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94D049BB133111EB);
    return x ^ (x >> 31);
}

/* ---- the pre-encoded stream ------------------------------------------------------------------- */

typedef struct message {
    uint32_t worker;
    uint64_t seq;
    size_t offset, size; /* into stream.data */
} message;

typedef struct stream {
    char *data;
    size_t size;
    message *msgs;
    size_t n_msgs;
    uint64_t block_events, stored_blocks, removed_blocks, requests;
    uint64_t seqs[EV_WORKERS];
} stream;

static void pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static uint64_t engine_hash(uint64_t key, uint32_t worker)
{
    uint64_t h = splitmix64(key ^ (UINT64_C(0x5151) + worker) * UINT64_C(0x9E3779B97F4A7C15));
    return h < 2 ? h + 2 : h;
}

static int build_stream(const km_trace *trace, uint64_t max_block_events, stream *st, char *err,
                        size_t err_size)
{
    memset(st, 0, sizeof *st);
    km_bench_lru lrus[EV_WORKERS];
    for (uint32_t w = 0; w < EV_WORKERS; w++)
        if (km_bench_lru_init(&lrus[w], WORKER_CAPACITY)) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    size_t msgs_cap = 1024;
    st->msgs = malloc(msgs_cap * sizeof *st->msgs);
    uint64_t *keys = NULL, *removed = NULL;
    size_t keys_cap = 0;
    uint32_t id_tokens[EV_TOKENS_PER_ID];
    for (size_t r = 0; r < trace->n_requests && st->block_events < max_block_events; r++) {
        const km_trace_request *q = &trace->requests[r];
        if (!q->n_ids)
            continue;
        uint32_t w = (uint32_t)(st->requests % EV_WORKERS); /* round-robin */
        uint32_t n_blocks = q->input_length / EV_BLOCK_SIZE;
        if (n_blocks > q->n_ids * EV_BLOCKS_PER_ID)
            n_blocks = q->n_ids * EV_BLOCKS_PER_ID;
        if (n_blocks > WORKER_CAPACITY / 2)
            n_blocks = WORKER_CAPACITY / 2;
        if (!n_blocks)
            continue;
        if (keys_cap < n_blocks) {
            keys_cap = n_blocks;
            keys = realloc(keys, keys_cap * sizeof *keys);
            removed = realloc(removed, keys_cap * sizeof *removed);
        }
        /* A block's key: the trace id (a chained prefix hash) and the block within it. */
        for (uint32_t b = 0; b < n_blocks; b++)
            keys[b] = ((uint64_t)q->ids[b / EV_BLOCKS_PER_ID] << 8 | (b % EV_BLOCKS_PER_ID)) + 1;
        km_bench_lru *l = &lrus[w];
        uint32_t cached = 0;
        while (cached < n_blocks && km_bench_lru_touch(l, keys[cached]))
            cached++;
        uint32_t fresh = n_blocks - cached;
        if (!fresh)
            continue;
        uint32_t n_removed = 0;
        while (l->count + fresh > WORKER_CAPACITY)
            removed[n_removed++] = engine_hash(km_bench_lru_evict(l), w);
        for (uint32_t b = cached; b < n_blocks; b++)
            km_bench_lru_insert(l, keys[b]);
        /* Eviction never takes the cached prefix: it was touched and fresh <= capacity / 2. */
        size_t start = buf.size;
        msgpack_pack_array(&pk, 3);
        msgpack_pack_double(&pk, (double)q->timestamp_ms / 1000.0);
        msgpack_pack_array(&pk, n_removed ? 2 : 1);
        if (n_removed) {
            msgpack_pack_array(&pk, 2);
            pack_str(&pk, "BlockRemoved");
            msgpack_pack_array(&pk, n_removed);
            for (uint32_t i = 0; i < n_removed; i++)
                msgpack_pack_uint64(&pk, removed[i]);
        }
        msgpack_pack_array(&pk, 6);
        pack_str(&pk, "BlockStored");
        msgpack_pack_array(&pk, fresh);
        for (uint32_t b = cached; b < n_blocks; b++)
            msgpack_pack_uint64(&pk, engine_hash(keys[b], w));
        if (cached)
            msgpack_pack_uint64(&pk, engine_hash(keys[cached - 1], w));
        else
            msgpack_pack_nil(&pk);
        msgpack_pack_array(&pk, fresh * EV_BLOCK_SIZE);
        uint32_t last_id = UINT32_MAX;
        for (uint32_t b = cached; b < n_blocks; b++) {
            uint32_t id = q->ids[b / EV_BLOCKS_PER_ID];
            if (id != last_id) {
                km_trace_id_tokens(id, EV_TOKENS_PER_ID, id_tokens);
                last_id = id;
            }
            const uint32_t *t = id_tokens + (b % EV_BLOCKS_PER_ID) * EV_BLOCK_SIZE;
            for (uint32_t k = 0; k < EV_BLOCK_SIZE; k++)
                msgpack_pack_uint32(&pk, t[k]);
        }
        msgpack_pack_uint32(&pk, EV_BLOCK_SIZE);
        msgpack_pack_nil(&pk); /* lora_id */
        msgpack_pack_int64(&pk, 0); /* data_parallel_rank */
        if (st->n_msgs == msgs_cap) {
            msgs_cap *= 2;
            st->msgs = realloc(st->msgs, msgs_cap * sizeof *st->msgs);
        }
        message *m = &st->msgs[st->n_msgs++];
        m->worker = w;
        m->seq = st->seqs[w]++;
        m->offset = start;
        m->size = buf.size - start;
        st->stored_blocks += fresh;
        st->removed_blocks += n_removed;
        st->block_events += fresh + n_removed;
        st->requests++;
    }
    free(keys);
    free(removed);
    for (uint32_t w = 0; w < EV_WORKERS; w++)
        km_bench_lru_free(&lrus[w]);
    st->data = msgpack_sbuffer_release(&buf);
    st->size = buf.size;
    msgpack_sbuffer_destroy(&buf);
    return 0;
}

static void stream_free(stream *st)
{
    free(st->data);
    free(st->msgs);
}

static km_index *make_index(void)
{
    km_index_config ic;
    km_index_config_init(&ic);
    ic.max_workers = 64;
    ic.log = km_bench_quiet_log;
    km_index *index = NULL;
    if (km_index_create(&ic, &index) != KM_OK)
        return NULL;
    return index;
}

static void feed_config(km_feed_config *fc)
{
    km_feed_config_init(fc);
    fc->block_size = EV_BLOCK_SIZE;
    fc->bootstrap_replay = false;
    fc->log = km_bench_quiet_log;
}

/* ---- inproc ----------------------------------------------------------------------------------- */

static int run_inproc(const stream *st, double *seconds, uint64_t *lost, uint64_t *pairs)
{
    km_index *index = make_index();
    km_feed_config fc;
    feed_config(&fc);
    km_feed *feed = NULL;
    km_kv_decoder *dec = NULL;
    if (!index || km_feed_create(index, &fc, &feed) || km_kv_decoder_create(NULL, &dec))
        return -1;
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        km_feed_worker_config wc = {w, "bench", false};
        km_feed_add_worker(feed, &wc, 1);
    }
    km_feed_flush(feed, 1, NULL);
    double t0 = km_bench_now_s();
    unsigned char seq_be[8];
    for (size_t i = 0; i < st->n_msgs; i++) {
        const message *m = &st->msgs[i];
        for (int k = 0; k < 8; k++)
            seq_be[k] = (unsigned char)(m->seq >> (56 - 8 * k));
        km_kv_frame frames[3] = {{"", 0}, {seq_be, 8}, {st->data + m->offset, m->size}};
        km_kv_message msg;
        if (km_kv_decode_message(dec, KM_KV_SOURCE_SUBSCRIBER, frames, 3, &msg) == KM_OK)
            km_feed_live(feed, m->worker, msg.seq, &msg.batch, 2);
        else
            km_feed_live(feed, m->worker, m->seq, NULL, 2);
        if (i % FLUSH_EVERY == FLUSH_EVERY - 1)
            km_feed_flush(feed, 3, NULL);
    }
    km_feed_flush(feed, 4, NULL);
    *seconds = km_bench_now_s() - t0;
    *lost = 0;
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        km_feed_worker_info info;
        km_feed_get_worker_info(feed, w, &info);
        *lost += info.counters.lost + info.counters.unknown_parent_blocks + info.counters.unknown_removes +
                 info.counters.malformed;
    }
    km_index_stats is;
    km_index_get_stats(index, &is);
    *pairs = is.pairs;
    km_kv_decoder_destroy(dec);
    km_feed_destroy(feed);
    km_index_destroy(index);
    return 0;
}

/* ---- zmq ---------------------------------------------------------------------------------------- */

typedef struct zpub {
    const stream *st;
    void *ctx;
    void *socks[EV_WORKERS];
    char endpoints[EV_WORKERS][64];
    volatile int go;
    uint64_t send_errors;
} zpub;

static void *zpub_main(void *p)
{
    zpub *z = p;
    while (!__atomic_load_n(&z->go, __ATOMIC_ACQUIRE))
        usleep(100);
    unsigned char seq_be[8];
    for (size_t i = 0; i < z->st->n_msgs; i++) {
        const message *m = &z->st->msgs[i];
        for (int k = 0; k < 8; k++)
            seq_be[k] = (unsigned char)(m->seq >> (56 - 8 * k));
        void *s = z->socks[m->worker];
        if (zmq_send(s, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(s, seq_be, 8, ZMQ_SNDMORE) < 0 ||
            zmq_send(s, z->st->data + m->offset, m->size, 0) < 0)
            z->send_errors++;
    }
    return NULL;
}

static int run_zmq(const stream *st, double *seconds, uint64_t *lost, uint64_t *pairs,
                   uint64_t *send_errors)
{
    zpub z;
    memset(&z, 0, sizeof z);
    z.st = st;
    z.ctx = zmq_ctx_new();
    int zero = 0;
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        z.socks[w] = zmq_socket(z.ctx, ZMQ_XPUB);
        zmq_setsockopt(z.socks[w], ZMQ_SNDHWM, &zero, sizeof zero);
        zmq_setsockopt(z.socks[w], ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_bind(z.socks[w], "tcp://127.0.0.1:*"))
            return -1;
        size_t len = sizeof z.endpoints[w];
        zmq_getsockopt(z.socks[w], ZMQ_LAST_ENDPOINT, z.endpoints[w], &len);
    }
    km_index *index = make_index();
    km_subscriber_config sc;
    km_subscriber_config_init(&sc);
    feed_config(&sc.feed);
    sc.receive_hwm = 0;
    sc.log = km_bench_quiet_log;
    sc.feed.max_queued_hashes = UINT64_C(1) << 26;
    km_subscriber *sub = NULL;
    if (!index || km_subscriber_create(index, &sc, &sub))
        return -1;
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        km_subscriber_worker sw = {w, NULL, z.endpoints[w], NULL};
        if (km_subscriber_add_worker(sub, &sw))
            return -1;
    }
    /* Wait for every subscription to reach its XPUB. */
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        char b[64];
        int timeout = 5000;
        zmq_setsockopt(z.socks[w], ZMQ_RCVTIMEO, &timeout, sizeof timeout);
        if (zmq_recv(z.socks[w], b, sizeof b, 0) < 0)
            return -1;
    }
    km_subscriber_flush(sub, NULL);
    pthread_t th;
    pthread_create(&th, NULL, zpub_main, &z);
    double t0 = km_bench_now_s();
    __atomic_store_n(&z.go, 1, __ATOMIC_RELEASE);
    uint64_t total = st->n_msgs;
    double deadline = t0 + 120;
    for (;;) {
        km_subscriber_flush(sub, NULL);
        km_subscriber_stats ss;
        km_subscriber_get_stats(sub, &ss);
        if (ss.live_messages >= total)
            break;
        if (km_bench_now_s() > deadline)
            break;
        usleep(1000);
    }
    km_subscriber_flush(sub, NULL);
    *seconds = km_bench_now_s() - t0;
    pthread_join(th, NULL);
    *send_errors = z.send_errors;
    *lost = 0;
    for (uint32_t w = 0; w < EV_WORKERS; w++) {
        km_feed_worker_info info;
        km_subscriber_get_worker_info(sub, w, &info);
        uint64_t missing = st->seqs[w] - (info.has_expected_seq ? info.expected_seq : 0);
        *lost += info.counters.lost + info.counters.history_unavailable + missing;
    }
    km_index_stats is;
    km_index_get_stats(index, &is);
    *pairs = is.pairs;
    km_subscriber_destroy(sub);
    km_index_destroy(index);
    for (uint32_t w = 0; w < EV_WORKERS; w++)
        zmq_close(z.socks[w]);
    zmq_ctx_term(z.ctx);
    return 0;
}

/* ---- restart ------------------------------------------------------------------------------------- */

#define RS_WORKERS 16u
#define RS_CHAIN 64u

/* Build ~target pairs through a feed (synthetic batches: chains of RS_CHAIN blocks per worker,
 * half of them shared by all workers), save; returns the pairs saved. */
static int restart_build(const char *path, uint64_t target, uint64_t *pairs_out, uint64_t *bytes_out)
{
    km_index *index = make_index();
    km_feed_config fc;
    feed_config(&fc);
    km_feed *feed = NULL;
    if (!index || km_feed_create(index, &fc, &feed))
        return -1;
    for (uint32_t w = 0; w < RS_WORKERS; w++) {
        char name[32];
        snprintf(name, sizeof name, "tcp://10.0.0.%u:5557", w);
        km_feed_worker_config wc = {w, name, true};
        km_feed_add_worker(feed, &wc, 1);
    }
    km_feed_action a;
    while (km_feed_next_action(feed, &a))
        ;
    uint64_t chains_per_worker = target / RS_WORKERS / RS_CHAIN;
    uint64_t hashes[RS_CHAIN];
    uint32_t *tokens = malloc(RS_CHAIN * EV_BLOCK_SIZE * sizeof *tokens);
    uint64_t seq[RS_WORKERS] = {0};
    for (uint64_t c = 0; c < chains_per_worker; c++) {
        for (uint32_t w = 0; w < RS_WORKERS; w++) {
            uint64_t content = c % 2 ? c : (c << 8 | w); /* odd chains shared by every worker */
            for (uint32_t i = 0; i < RS_CHAIN * EV_BLOCK_SIZE; i++)
                tokens[i] = (uint32_t)splitmix64(content * 4096 + i);
            for (uint32_t b = 0; b < RS_CHAIN; b++)
                hashes[b] = engine_hash(content * RS_CHAIN + b + 1, w);
            km_kv_event e;
            memset(&e, 0, sizeof e);
            e.kind = KM_KV_EVENT_BLOCK_STORED;
            e.block_hashes = hashes;
            e.n_block_hashes = RS_CHAIN;
            e.token_ids = tokens;
            e.n_token_ids = RS_CHAIN * EV_BLOCK_SIZE;
            e.block_size = EV_BLOCK_SIZE;
            e.medium = KM_KV_MEDIUM_GPU;
            km_kv_batch batch;
            memset(&batch, 0, sizeof batch);
            batch.events = &e;
            batch.n_events = 1;
            batch.n_payload_events = 1;
            km_feed_live(feed, w, seq[w]++, &batch, 2);
        }
        if (c % 64 == 63)
            km_feed_flush(feed, 3, NULL);
    }
    free(tokens);
    int rc = km_feed_save(feed, path, 4);
    if (rc)
        fprintf(stderr, "kvmatch bench events: save: %s\n", km_feed_last_error(feed));
    km_index_stats is;
    km_index_get_stats(index, &is);
    *pairs_out = is.pairs;
    km_feed_destroy(feed);
    km_index_destroy(index);
    FILE *f = fopen(path, "rb");
    *bytes_out = 0;
    if (f) {
        fseek(f, 0, SEEK_END);
        *bytes_out = (uint64_t)ftell(f);
        fclose(f);
    }
    return rc ? -1 : 0;
}

/* The two parts of a restore, timed apart: km_index_load, then km_feed_import_state. */
static int restart_parts(const char *path, double *load_s, double *import_s)
{
    km_index *index = make_index();
    km_feed_config fc;
    feed_config(&fc);
    km_feed *feed = NULL;
    if (!index || km_feed_create(index, &fc, &feed))
        return -1;
    void *user = NULL;
    size_t size = 0;
    double t0 = km_bench_now_s();
    int rc = km_index_load(index, path, &user, &size);
    double t1 = km_bench_now_s();
    if (!rc)
        rc = km_feed_import_state(feed, user, size, km_feed_clock_ns());
    *import_s = km_bench_now_s() - t1;
    *load_s = t1 - t0;
    free(user);
    km_feed_destroy(feed);
    km_index_destroy(index);
    return rc ? -1 : 0;
}

static int restart_once(const char *path, double *ready_s, uint64_t *pairs)
{
    double t0 = km_bench_now_s();
    km_index *index = make_index();
    km_feed_config fc;
    feed_config(&fc);
    km_feed *feed = NULL;
    if (!index || km_feed_create(index, &fc, &feed))
        return -1;
    int rc = km_feed_restore(feed, path, km_feed_clock_ns());
    if (rc) {
        fprintf(stderr, "kvmatch bench events: restore: %s\n", km_feed_last_error(feed));
        return -1;
    }
    for (uint32_t w = 0; w < RS_WORKERS; w++) {
        char name[32];
        snprintf(name, sizeof name, "tcp://10.0.0.%u:5557", w);
        km_feed_worker_config wc = {w, name, true};
        km_feed_add_worker(feed, &wc, km_feed_clock_ns());
    }
    *ready_s = km_bench_now_s() - t0;
    uint32_t resuming = 0;
    km_feed_action a;
    while (km_feed_next_action(feed, &a))
        resuming += a.kind == KM_FEED_ACTION_REPLAY_REQUEST;
    km_index_stats is;
    km_index_get_stats(index, &is);
    *pairs = is.pairs;
    km_feed_destroy(feed);
    km_index_destroy(index);
    return resuming == RS_WORKERS ? 0 : -1;
}

/* ---- main -------------------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvmatch bench events [--json] [--quick] [--trace PATH]\n"
               "  KV-event ingestion (decode, hash, apply) in process and over loopback ZMQ, and\n"
               "  time to ready after a restart from a snapshot (docs/BENCHMARKS.md)\n"
               "  --quick   smaller stream and snapshot, fewer reps (< 30 s)\n");
}

int km_bench_events_main(int argc, char **argv)
{
    int json = 0, quick = 0;
    const char *trace_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc)
            trace_path = argv[++i];
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvmatch bench events: unknown or incomplete option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!trace_path)
        trace_path = km_trace_default_path();
    json_t *machine = km_bench_machine_json();
    km_trace trace;
    memset(&trace, 0, sizeof trace);
    char err[512] = "";
    if (km_trace_load_mooncake(trace_path, &trace, err, sizeof err) != KM_OK) {
        fprintf(stderr, "kvmatch bench events: cannot load the Mooncake trace: %s\n"
                        "  (pass --trace PATH or set KM_MOONCAKE_TRACE)\n", err);
        json_decref(machine);
        return 2;
    }
    int reps = quick ? 3 : 5;
    uint64_t max_events = quick ? 1500000u : 6000000u;
    uint64_t restart_pairs = quick ? 2000000u : 10240000u;
    int restart_reps = quick ? 2 : 3;
    double tg = km_bench_now_s();
    stream st;
    if (build_stream(&trace, max_events, &st, err, sizeof err)) {
        fprintf(stderr, "kvmatch bench events: %s\n", err);
        return 1;
    }
    double gen_s = km_bench_now_s() - tg;
    km_trace_free(&trace);

    double v_in[8], v_zmq[8];
    uint64_t lost_in = 0, lost_zmq = 0, pairs_in = 0, pairs_zmq = 0, send_errors = 0;
    for (int r = 0; r < reps; r++) {
        uint64_t lost, pairs, se = 0;
        if (run_inproc(&st, &v_in[r], &lost, &pairs)) {
            fprintf(stderr, "kvmatch bench events: inproc run failed\n");
            return 1;
        }
        lost_in += lost;
        pairs_in = pairs;
        if (run_zmq(&st, &v_zmq[r], &lost, &pairs, &se)) {
            fprintf(stderr, "kvmatch bench events: zmq run failed\n");
            return 1;
        }
        lost_zmq += lost;
        pairs_zmq = pairs;
        send_errors += se;
    }
    double s_in = km_bench_median(v_in, (size_t)reps), s_zmq = km_bench_median(v_zmq, (size_t)reps);

    char dir[] = "/tmp/kvmatch-bench-events-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "kvmatch bench events: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    char path[128];
    snprintf(path, sizeof path, "%s/kvmatch.snap", dir);
    uint64_t saved_pairs = 0, file_bytes = 0, restored_pairs = 0;
    double tb = km_bench_now_s();
    int rc = restart_build(path, restart_pairs, &saved_pairs, &file_bytes);
    double build_s = km_bench_now_s() - tb;
    double v_ready[8];
    for (int r = 0; !rc && r < restart_reps; r++)
        rc = restart_once(path, &v_ready[r], &restored_pairs);
    double v_load[8], v_import[8];
    for (int r = 0; !rc && r < restart_reps; r++)
        rc = restart_parts(path, &v_load[r], &v_import[r]);
    unlink(path);
    rmdir(dir);
    if (rc || restored_pairs != saved_pairs) {
        fprintf(stderr, "kvmatch bench events: restart run failed\n");
        return 1;
    }
    double ready = km_bench_median(v_ready, (size_t)restart_reps);
    double load_s = km_bench_median(v_load, (size_t)restart_reps);
    double import_s = km_bench_median(v_import, (size_t)restart_reps);

    double eps_in = (double)st.block_events / s_in, eps_zmq = (double)st.block_events / s_zmq;
    char command[512] = "kvmatch bench";
    for (int i = 0; i < argc; i++) {
        size_t len = strlen(command);
        snprintf(command + len, sizeof command - len, " %s", argv[i]);
    }
    if (json) {
        json_t *notes = json_array();
        json_array_append_new(notes, json_sprintf(
            "stream generated and msgpack-encoded before timing in %.2f s (not measured)", gen_s));
        json_array_append_new(notes, json_string(
            "inproc: one thread, decode + km_feed_live + km_feed_flush every 64 messages; zmq: "
            "publisher thread with one XPUB per worker, km_subscriber I/O thread, main thread "
            "flushing every 1 ms; both end when every message is applied"));
        json_array_append_new(notes, json_sprintf(
            "restart: synthetic snapshot (chains of %u blocks, half shared by all %u workers) "
            "built through the feed in %.1f s; the file (%.0f MB) is in the page cache; ready = "
            "create index + feed, km_feed_restore (read, checksum, validate index and feed state, "
            "install), claim every worker (each asks for a replay from its saved seq + 1)",
            RS_CHAIN, RS_WORKERS, build_s, (double)file_bytes / 1e6));
        json_t *o = json_pack(
            "{s:s, s:o, s:o, s:o, s:{s:I, s:f, s:f, s:f, s:I, s:I}, s:{s:s, s:I, s:I, s:I, s:I, s:I, s:I, "
            "s:I, s:I, s:I, s:I, s:b}, s:o}",
            "command", command, "machine", machine,
            "results",
            json_pack("[{s:s, s:f, s:f, s:I, s:I}, {s:s, s:f, s:f, s:I, s:I, s:I}]", "path",
                      "inproc", "block_events_per_s", km_bench_round_to(eps_in, 1), "seconds",
                      km_bench_round_to(s_in, 0.0001), "lost_or_unmatched", (json_int_t)lost_in,
                      "pairs_after", (json_int_t)pairs_in, "path", "zmq", "block_events_per_s",
                      km_bench_round_to(eps_zmq, 1), "seconds", km_bench_round_to(s_zmq, 0.0001), "dropped",
                      (json_int_t)lost_zmq, "send_errors", (json_int_t)send_errors, "pairs_after",
                      (json_int_t)pairs_zmq),
            "targets", json_pack("{s:f, s:f}", "block_events_per_s", 2e6, "ready_s", 2.0),
            "restart", "pairs", (json_int_t)saved_pairs, "ready_s", km_bench_round_to(ready, 0.001),
            "index_load_s", km_bench_round_to(load_s, 0.001), "feed_import_s", km_bench_round_to(import_s, 0.001),
            "file_bytes", (json_int_t)file_bytes, "reps", (json_int_t)restart_reps,
            "workload", "trace", trace_path, "workers", (json_int_t)EV_WORKERS, "block_size",
            (json_int_t)EV_BLOCK_SIZE, "tokens_per_id", (json_int_t)EV_TOKENS_PER_ID,
            "worker_capacity_blocks", (json_int_t)WORKER_CAPACITY, "requests",
            (json_int_t)st.requests, "messages", (json_int_t)st.n_msgs, "block_events",
            (json_int_t)st.block_events, "stored_blocks", (json_int_t)st.stored_blocks,
            "removed_blocks", (json_int_t)st.removed_blocks, "reps", (json_int_t)reps, "quick",
            quick, "notes", notes);
        char *s = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
        printf("%s\n", s);
        free(s);
        json_decref(o);
    } else {
        json_decref(machine);
        printf("kvmatch bench events: %" PRIu64 " block events in %zu messages (%" PRIu64
               " stored, %" PRIu64 " removed), %d reps\n",
               st.block_events, st.n_msgs, st.stored_blocks, st.removed_blocks, reps);
        printf("  inproc  %12.0f block events/s  (%.3f s, %" PRIu64 " lost)\n", eps_in, s_in, lost_in);
        printf("  zmq     %12.0f block events/s  (%.3f s, %" PRIu64 " dropped)\n", eps_zmq, s_zmq,
               lost_zmq);
        printf("  restart %" PRIu64 " pairs: ready in %.3f s (km_bench_median of %d; index load %.3f s, "
               "feed state %.3f s)\n", saved_pairs, ready, restart_reps, load_s, import_s);
    }
    stream_free(&st);
    return 0;
}
