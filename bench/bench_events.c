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
 *  - engine_steps: a second stream shaped like a fleet of engines (build_engine_stream: one small
 *    message per engine step) through the same publisher and subscriber as zmq, reported in
 *    messages/s; zmq_floor: the same messages received and dropped undecoded, alternating with
 *    engine_steps, the transport's own ceiling in the same run. Both are timed in the steady state
 *    a router following a running fleet sees: the messages up to the one after which every engine
 *    has evicted (its cache is full) are sent and applied first, untimed (stream.warm_msgs), while
 *    the index's tables and the feed's maps grow from empty; the in-process run of this stream
 *    likewise.
 *  - restart: an index with ~10 M (block, worker) pairs built through the feed (synthetic
 *    batches, not the trace: the trace's LRU steady state is far smaller), saved with
 *    km_feed_save; timed: create index + feed, km_feed_restore, claim every worker (ready: the
 *    state is restored and every worker resumes).
 * Block events = stored blocks + removed blocks. Medians over reps. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
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
#include "cli/options.h"
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
#define STREAM_MAX_WORKERS 64u

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
    uint64_t block_events, stored_blocks, removed_blocks, requests, clears;
    uint32_t n_workers;
    uint64_t seqs[STREAM_MAX_WORKERS];
    /* Messages sent and applied before the timer starts (0: none), and their block events. */
    size_t warm_msgs;
    uint64_t warm_block_events;
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
    st->n_workers = EV_WORKERS;
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
    st->size = buf.size; /* read before the release empties buf */
    st->data = msgpack_sbuffer_release(&buf);
    msgpack_sbuffer_destroy(&buf);
    return 0;
}

/* ---- the engine-shaped stream ----------------------------------------------------------------- */

/* One message per simulated engine step, as vLLM's scheduler emits them: each step a few running
 * requests fill one to three new blocks each (one BlockStored per request, parent = the request's
 * previous block), the engine evicts least-recently finished blocks once it holds ENG_CAPACITY
 * (one BlockRemoved, a finished request's blocks tail first), and every ENG_CLEAR_EVERY-th
 * step of the fleet clears one engine's whole cache (AllBlocksCleared, alone in its message). Engines take
 * turns, so messages of different engines interleave as a fleet's would. */
#define ENG_ENGINES 64u
#define ENG_CAPACITY 4096u  /* blocks per engine */
#define ENG_RUNNING 8u      /* requests in flight per engine */
#define ENG_CLEAR_EVERY 20000u
#define ENG_MESSAGES 200000u
#define ENG_MESSAGES_QUICK 50000u
#define ENG_REPS 7

typedef struct eng_chain {
    uint64_t *hashes; /* engine hashes of the request's blocks, in order */
    uint32_t n, cap, target;
} eng_chain;

typedef struct eng_state {
    eng_chain running[ENG_RUNNING];
    eng_chain *finished; /* FIFO ring of finished requests, oldest at head */
    uint32_t fin_head, fin_count, fin_cap;
    uint32_t stored;
    uint64_t next_request;
} eng_state;

static uint64_t eng_rng(uint64_t *s)
{
    *s += UINT64_C(0x9E3779B97F4A7C15);
    return splitmix64(*s);
}

static void eng_chain_push(eng_chain *c, uint64_t h)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 16;
        c->hashes = realloc(c->hashes, c->cap * sizeof *c->hashes);
    }
    c->hashes[c->n++] = h;
}

static void eng_start(eng_state *e, eng_chain *c, uint64_t *rng)
{
    c->n = 0;
    c->target = 4 + (uint32_t)(eng_rng(rng) % 61); /* 4 .. 64 blocks: 64 .. 1,024 tokens */
    e->next_request++;
}

static void eng_finish(eng_state *e, eng_chain *c)
{
    if (e->fin_count == e->fin_cap) {
        uint32_t cap = e->fin_cap ? 2 * e->fin_cap : 64;
        eng_chain *f = calloc(cap, sizeof *f);
        for (uint32_t i = 0; i < e->fin_count; i++)
            f[i] = e->finished[(e->fin_head + i) % e->fin_cap];
        free(e->finished);
        e->finished = f;
        e->fin_cap = cap;
        e->fin_head = 0;
    }
    eng_chain *slot = &e->finished[(e->fin_head + e->fin_count++) % e->fin_cap];
    *slot = *c; /* hand over the hashes; the running slot gets a fresh array */
    memset(c, 0, sizeof *c);
}

static void eng_reset(eng_state *e)
{
    for (uint32_t i = 0; i < e->fin_count; i++)
        free(e->finished[(e->fin_head + i) % e->fin_cap].hashes);
    e->fin_head = e->fin_count = 0;
    for (uint32_t i = 0; i < ENG_RUNNING; i++)
        e->running[i].n = 0;
    e->stored = 0;
}

static void eng_free(eng_state *e)
{
    eng_reset(e);
    free(e->finished);
    for (uint32_t i = 0; i < ENG_RUNNING; i++)
        free(e->running[i].hashes);
}

/* What the timers cover: the messages after the warm-up, and their block events. */
static size_t timed_msgs(const stream *st)
{
    return st->n_msgs - st->warm_msgs;
}

static uint64_t timed_block_events(const stream *st)
{
    return st->block_events - st->warm_block_events;
}

static void stream_add_message(stream *st, size_t *msgs_cap, uint32_t w, size_t start, size_t end)
{
    if (st->n_msgs == *msgs_cap) {
        *msgs_cap *= 2;
        st->msgs = realloc(st->msgs, *msgs_cap * sizeof *st->msgs);
    }
    message *m = &st->msgs[st->n_msgs++];
    m->worker = w;
    m->seq = st->seqs[w]++;
    m->offset = start;
    m->size = end - start;
}

/* The warm-up (every engine fills its cache and evicts once), then n_messages more: the timed
 * part. */
static int build_engine_stream(uint64_t n_messages, stream *st)
{
    memset(st, 0, sizeof *st);
    st->n_workers = ENG_ENGINES;
    eng_state *engines = calloc(ENG_ENGINES, sizeof *engines);
    size_t msgs_cap = 1024;
    st->msgs = malloc(msgs_cap * sizeof *st->msgs);
    if (!engines || !st->msgs)
        return -1;
    uint64_t rng = 42;
    for (uint32_t w = 0; w < ENG_ENGINES; w++)
        for (uint32_t i = 0; i < ENG_RUNNING; i++)
            eng_start(&engines[w], &engines[w].running[i], &rng);
    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    uint64_t removed[ENG_CAPACITY];
    uint64_t block_uid = 1;
    /* The warm-up ends with the message after which every engine has evicted at least once. */
    bool evicted[ENG_ENGINES] = {false};
    uint32_t n_evicted = 0;
    for (uint64_t m = 0; !st->warm_msgs || st->n_msgs < st->warm_msgs + n_messages; m++) {
        uint32_t w = (uint32_t)(m % ENG_ENGINES);
        eng_state *e = &engines[w];
        size_t start = buf.size;
        double ts = (double)m * 1e-4;
        if (m % ENG_CLEAR_EVERY == ENG_CLEAR_EVERY - 1) {
            msgpack_pack_array(&pk, 3);
            msgpack_pack_double(&pk, ts);
            msgpack_pack_array(&pk, 1);
            msgpack_pack_array(&pk, 1);
            pack_str(&pk, "AllBlocksCleared");
            msgpack_pack_int64(&pk, 0);
            eng_reset(e);
            st->clears++;
            stream_add_message(st, &msgs_cap, w, start, buf.size);
            continue;
        }
        /* Which requests advance this step, and by how many blocks. */
        uint32_t n_advance = 4 + (uint32_t)(eng_rng(&rng) % 5); /* 4 .. 8 */
        uint32_t grow[ENG_RUNNING] = {0};
        uint32_t new_blocks = 0;
        for (uint32_t i = 0; i < n_advance; i++) {
            uint32_t r = (uint32_t)(eng_rng(&rng) % ENG_RUNNING);
            uint64_t x = eng_rng(&rng) % 10;
            uint32_t g = x < 6 ? 1 : x < 9 ? 2 : 3;
            eng_chain *c = &e->running[r];
            if (c->n + grow[r] + g > c->target)
                g = c->target - c->n - grow[r];
            grow[r] += g;
            new_blocks += g;
        }
        /* Evict finished requests' blocks, tail first, to make room. */
        uint32_t n_removed = 0;
        while (e->stored + new_blocks > ENG_CAPACITY && e->fin_count) {
            eng_chain *f = &e->finished[e->fin_head];
            removed[n_removed++] = f->hashes[--f->n];
            e->stored--;
            if (!f->n) {
                free(f->hashes);
                memset(f, 0, sizeof *f);
                e->fin_head = (e->fin_head + 1) % e->fin_cap;
                e->fin_count--;
            }
        }
        uint32_t n_stored_events = 0;
        for (uint32_t r = 0; r < ENG_RUNNING; r++)
            n_stored_events += grow[r] > 0;
        msgpack_pack_array(&pk, 3);
        msgpack_pack_double(&pk, ts);
        msgpack_pack_array(&pk, n_stored_events + (n_removed > 0));
        if (n_removed) {
            msgpack_pack_array(&pk, 2);
            pack_str(&pk, "BlockRemoved");
            msgpack_pack_array(&pk, n_removed);
            for (uint32_t i = 0; i < n_removed; i++)
                msgpack_pack_uint64(&pk, removed[i]);
        }
        for (uint32_t r = 0; r < ENG_RUNNING; r++) {
            if (!grow[r])
                continue;
            eng_chain *c = &e->running[r];
            uint64_t parent = c->n ? c->hashes[c->n - 1] : 0;
            int has_parent = c->n > 0;
            uint32_t first = c->n;
            for (uint32_t b = 0; b < grow[r]; b++)
                eng_chain_push(c, engine_hash(block_uid++, w));
            msgpack_pack_array(&pk, 6);
            pack_str(&pk, "BlockStored");
            msgpack_pack_array(&pk, grow[r]);
            for (uint32_t b = first; b < c->n; b++)
                msgpack_pack_uint64(&pk, c->hashes[b]);
            if (has_parent)
                msgpack_pack_uint64(&pk, parent);
            else
                msgpack_pack_nil(&pk);
            msgpack_pack_array(&pk, grow[r] * EV_BLOCK_SIZE);
            for (uint32_t b = first; b < c->n; b++)
                for (uint32_t k = 0; k < EV_BLOCK_SIZE; k++)
                    msgpack_pack_uint32(&pk, (uint32_t)(splitmix64(c->hashes[b] + k) % 32000u));
            msgpack_pack_uint32(&pk, EV_BLOCK_SIZE);
            msgpack_pack_nil(&pk); /* lora_id */
            e->stored += grow[r];
            if (c->n == c->target) {
                eng_finish(e, c);
                eng_start(e, c, &rng);
            }
        }
        msgpack_pack_int64(&pk, 0); /* data_parallel_rank */
        st->stored_blocks += new_blocks;
        st->removed_blocks += n_removed;
        st->block_events += new_blocks + n_removed;
        stream_add_message(st, &msgs_cap, w, start, buf.size);
        if (n_removed && !evicted[w]) {
            evicted[w] = true;
            if (++n_evicted == ENG_ENGINES) {
                st->warm_msgs = st->n_msgs;
                st->warm_block_events = st->block_events;
            }
        }
    }
    for (uint32_t w = 0; w < ENG_ENGINES; w++)
        eng_free(&engines[w]);
    free(engines);
    st->size = buf.size; /* read before the release empties buf */
    st->data = msgpack_sbuffer_release(&buf);
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

/* The calling thread's CPU time: on a shared machine it moves less with the other jobs' load than
 * the wall clock does, so A/B pairs of the in-process path read it too. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* cpu_seconds (may be NULL): the thread CPU time of the timed part. */
static int run_inproc(const stream *st, double *seconds, double *cpu_seconds, uint64_t *lost,
                      uint64_t *pairs)
{
    km_index *index = make_index();
    km_feed_config fc;
    feed_config(&fc);
    km_feed *feed = NULL;
    km_kv_decoder *dec = NULL;
    if (!index || km_feed_create(index, &fc, &feed) || km_kv_decoder_create(NULL, &dec))
        return -1;
    for (uint32_t w = 0; w < st->n_workers; w++) {
        km_feed_worker_config wc = {w, "bench", false};
        km_feed_add_worker(feed, &wc, 1);
    }
    km_feed_flush(feed, 1, NULL);
    double t0 = km_bench_now_s(), cpu0 = thread_cpu_s();
    unsigned char seq_be[8];
    for (size_t i = 0; i < st->n_msgs; i++) {
        if (i == st->warm_msgs && i) { /* the warm-up applied: the timed part starts here */
            km_feed_flush(feed, 3, NULL);
            t0 = km_bench_now_s();
            cpu0 = thread_cpu_s();
        }
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
    if (cpu_seconds)
        *cpu_seconds = thread_cpu_s() - cpu0;
    *lost = 0;
    for (uint32_t w = 0; w < st->n_workers; w++) {
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

/* Time on a CPU of this process's thread named km-subscriber (the subscriber's I/O thread; the
 * bench runs one subscriber at a time), in seconds (/proc/self/task/TID/schedstat: the first
 * field is nanoseconds on a CPU); -1 when it cannot be read. */
static double subscriber_thread_cpu_s(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -1;
    double seconds = -1;
    for (struct dirent *e; seconds < 0 && (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char file[96], name[32] = "";
        snprintf(file, sizeof file, "/proc/self/task/%.20s/comm", e->d_name);
        FILE *f = fopen(file, "r");
        if (!f)
            continue;
        if (fgets(name, sizeof name, f))
            name[strcspn(name, "\n")] = '\0';
        fclose(f);
        if (strcmp(name, "km-subscriber") != 0)
            continue;
        snprintf(file, sizeof file, "/proc/self/task/%.20s/schedstat", e->d_name);
        unsigned long long ns;
        if ((f = fopen(file, "r"))) {
            if (fscanf(f, "%llu", &ns) == 1)
                seconds = (double)ns * 1e-9;
            fclose(f);
        }
    }
    closedir(d);
    return seconds;
}

typedef struct zpub {
    const stream *st;
    void *ctx;
    void *socks[STREAM_MAX_WORKERS];
    char endpoints[STREAM_MAX_WORKERS][64];
    volatile int go;
    volatile int resume; /* set once the first st->warm_msgs messages have arrived */
    uint64_t send_errors;
} zpub;

static void *zpub_main(void *p)
{
    zpub *z = p;
    while (!__atomic_load_n(&z->go, __ATOMIC_ACQUIRE))
        usleep(100);
    unsigned char seq_be[8];
    for (size_t i = 0; i < z->st->n_msgs; i++) {
        if (i == z->st->warm_msgs && i)
            while (!__atomic_load_n(&z->resume, __ATOMIC_ACQUIRE))
                usleep(50);
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

/* cpu_s (may be NULL): the CPU time of the timed part, [0] the subscriber's I/O thread, [1] the
 * thread calling km_subscriber_flush (this one); -1 where it cannot be read. */
static int run_zmq(const stream *st, double *seconds, uint64_t *lost, uint64_t *pairs,
                   uint64_t *send_errors, double *cpu_s)
{
    zpub z;
    memset(&z, 0, sizeof z);
    z.st = st;
    z.ctx = zmq_ctx_new();
    int zero = 0;
    for (uint32_t w = 0; w < st->n_workers; w++) {
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
    for (uint32_t w = 0; w < st->n_workers; w++) {
        km_subscriber_worker sw = {w, NULL, z.endpoints[w], NULL};
        if (km_subscriber_add_worker(sub, &sw))
            return -1;
    }
    /* Wait for every subscription to reach its XPUB. */
    for (uint32_t w = 0; w < st->n_workers; w++) {
        char b[64];
        int timeout = 5000;
        zmq_setsockopt(z.socks[w], ZMQ_RCVTIMEO, &timeout, sizeof timeout);
        if (zmq_recv(z.socks[w], b, sizeof b, 0) < 0)
            return -1;
    }
    km_subscriber_flush(sub, NULL);
    pthread_t th;
    pthread_create(&th, NULL, zpub_main, &z);
    double deadline = km_bench_now_s() + 120;
    __atomic_store_n(&z.go, 1, __ATOMIC_RELEASE);
    /* The warm-up: sent, received and applied before the timer starts. */
    for (km_subscriber_stats ss; st->warm_msgs && km_bench_now_s() < deadline; usleep(1000)) {
        km_subscriber_flush(sub, NULL);
        km_subscriber_get_stats(sub, &ss);
        if (ss.live_messages >= st->warm_msgs)
            break;
    }
    km_subscriber_flush(sub, NULL);
    double t0 = km_bench_now_s(), io0 = subscriber_thread_cpu_s(), flush0 = thread_cpu_s();
    __atomic_store_n(&z.resume, 1, __ATOMIC_RELEASE);
    uint64_t total = st->n_msgs;
    deadline = t0 + 120;
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
    if (cpu_s) {
        double io1 = subscriber_thread_cpu_s();
        cpu_s[0] = io0 >= 0 && io1 >= 0 ? io1 - io0 : -1;
        cpu_s[1] = thread_cpu_s() - flush0;
    }
    pthread_join(th, NULL);
    *send_errors = z.send_errors;
    *lost = 0;
    for (uint32_t w = 0; w < st->n_workers; w++) {
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
    for (uint32_t w = 0; w < st->n_workers; w++)
        zmq_close(z.socks[w]);
    zmq_ctx_term(z.ctx);
    return 0;
}

/* ---- zmq_floor ---------------------------------------------------------------------------------- */

/* The transport alone: the same publisher and messages, one SUB per worker polled on this thread,
 * every part received (zmq_msg_recv) and dropped undecoded; timed from the first send until every
 * message arrived. The SUBs live in a ZMQ context of their own, as km_subscriber's do: one I/O
 * thread sends and another receives, in both rows. */
static int run_zmq_floor(const stream *st, double *seconds, uint64_t *lost)
{
    zpub z;
    memset(&z, 0, sizeof z);
    z.st = st;
    z.ctx = zmq_ctx_new();
    void *rctx = zmq_ctx_new();
    if (!z.ctx || !rctx)
        return -1;
    int zero = 0;
    void *subs[STREAM_MAX_WORKERS];
    zmq_pollitem_t items[STREAM_MAX_WORKERS];
    for (uint32_t w = 0; w < st->n_workers; w++) {
        z.socks[w] = zmq_socket(z.ctx, ZMQ_XPUB);
        zmq_setsockopt(z.socks[w], ZMQ_SNDHWM, &zero, sizeof zero);
        zmq_setsockopt(z.socks[w], ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_bind(z.socks[w], "tcp://127.0.0.1:*"))
            return -1;
        size_t len = sizeof z.endpoints[w];
        zmq_getsockopt(z.socks[w], ZMQ_LAST_ENDPOINT, z.endpoints[w], &len);
        subs[w] = zmq_socket(rctx, ZMQ_SUB);
        zmq_setsockopt(subs[w], ZMQ_RCVHWM, &zero, sizeof zero);
        zmq_setsockopt(subs[w], ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(subs[w], ZMQ_SUBSCRIBE, "", 0);
        if (zmq_connect(subs[w], z.endpoints[w]))
            return -1;
        items[w] = (zmq_pollitem_t){subs[w], 0, ZMQ_POLLIN, 0};
    }
    for (uint32_t w = 0; w < st->n_workers; w++) {
        char b[64];
        int timeout = 5000;
        zmq_setsockopt(z.socks[w], ZMQ_RCVTIMEO, &timeout, sizeof timeout);
        if (zmq_recv(z.socks[w], b, sizeof b, 0) < 0)
            return -1;
    }
    pthread_t th;
    pthread_create(&th, NULL, zpub_main, &z);
    double t0 = km_bench_now_s();
    __atomic_store_n(&z.go, 1, __ATOMIC_RELEASE);
    uint64_t received = 0;
    double deadline = t0 + 120;
    zmq_msg_t part;
    zmq_msg_init(&part);
    int timing = !st->warm_msgs;
    while (received < st->n_msgs && km_bench_now_s() < deadline) {
        if (!timing && received >= st->warm_msgs) { /* the warm-up has arrived */
            timing = 1;
            t0 = km_bench_now_s();
            __atomic_store_n(&z.resume, 1, __ATOMIC_RELEASE);
        }
        if (zmq_poll(items, (int)st->n_workers, 100) <= 0)
            continue;
        for (uint32_t w = 0; w < st->n_workers; w++) {
            if (!(items[w].revents & ZMQ_POLLIN))
                continue;
            while (zmq_msg_recv(&part, subs[w], ZMQ_DONTWAIT) >= 0)
                if (!zmq_msg_more(&part))
                    received++;
        }
    }
    *seconds = km_bench_now_s() - t0;
    zmq_msg_close(&part);
    __atomic_store_n(&z.resume, 1, __ATOMIC_RELEASE); /* a warm-up that never arrived */
    pthread_join(th, NULL);
    *lost = st->n_msgs - received + z.send_errors;
    for (uint32_t w = 0; w < st->n_workers; w++) {
        zmq_close(subs[w]);
        zmq_close(z.socks[w]);
    }
    zmq_ctx_term(rctx);
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

/* --engine-steps-only: the engine-shaped rows alone, for A/B pairs of the per-message path. */
static int engine_steps_only(int reps, uint64_t n_messages, int inproc_only)
{
    stream es;
    if (build_engine_stream(n_messages, &es))
        return 1;
    printf("engine steps: %zu messages from %u engines, %" PRIu64 " block events; timed: the last "
           "%zu (%" PRIu64 " block events), after every engine's cache has filled\n", es.n_msgs,
           ENG_ENGINES, es.block_events, timed_msgs(&es), timed_block_events(&es));
    double s_in, cpu_in;
    uint64_t lost_in, pairs_in;
    if (run_inproc(&es, &s_in, &cpu_in, &lost_in, &pairs_in))
        return 1;
    printf("  inproc       %10.0f messages/s, %10.0f per CPU second (%" PRIu64 " lost or unmatched, %"
           PRIu64 " pairs)\n", (double)timed_msgs(&es) / s_in, (double)timed_msgs(&es) / cpu_in,
           lost_in, pairs_in);
    double cpu_per_msg[ENG_REPS];
    int n_cpu = 0;
    for (int r = 0; r < reps && !inproc_only; r++) {
        double s_steps, s_floor, cpu_s[2];
        uint64_t lost, lost_floor, pairs, se = 0;
        double rt_steps = km_bench_cpu_round_trip_ns();
        if (run_zmq(&es, &s_steps, &lost, &pairs, &se, cpu_s))
            return 1;
        double rt_floor = km_bench_cpu_round_trip_ns();
        if (run_zmq_floor(&es, &s_floor, &lost_floor))
            return 1;
        printf("  engine_steps %10.0f messages/s (%" PRIu64 " dropped)   zmq_floor %10.0f messages/s"
               "   ratio %.2f   CPU round trip before each %.0f / %.0f ns\n",
               (double)timed_msgs(&es) / s_steps, lost, (double)timed_msgs(&es) / s_floor,
               s_floor / s_steps, rt_steps, rt_floor);
        if (cpu_s[0] >= 0 && n_cpu < ENG_REPS) {
            double us = 1e6 / (double)timed_msgs(&es);
            cpu_per_msg[n_cpu++] = (cpu_s[0] + cpu_s[1]) * us;
            printf("    kvmatch CPU per message %5.2f us: I/O thread %5.2f, flushing thread "
                   "%5.2f\n", (cpu_s[0] + cpu_s[1]) * us, cpu_s[0] * us, cpu_s[1] * us);
        }
    }
    if (n_cpu)
        printf("  kvmatch CPU per message, median of %d: %.2f us\n", n_cpu,
               km_bench_median(cpu_per_msg, (size_t)n_cpu));
    stream_free(&es);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvmatch bench events [--json] [--quick] [--trace PATH]\n"
               "       kvmatch bench events --engine-steps-only [--quick] [--messages N] [--inproc]\n"
               "  KV-event ingestion (decode, hash, apply) in process and over loopback ZMQ, and\n"
               "  time to ready after a restart from a snapshot (docs/BENCHMARKS.md)\n"
               "  --quick   smaller stream and snapshot, fewer reps (< 30 s)\n"
               "  --engine-steps-only  only the engine_steps and zmq_floor rows, as text (for A/B pairs),\n"
               "                       with kvmatch's CPU time per message on the real path\n"
               "    --messages N       that many engine steps timed, after a warm-up that fills every\n"
               "                       engine's cache (default 200000, 50000 with --quick)\n"
               "    --inproc           the engine steps in process only (decode, feed, flush every 64)\n");
}

int km_bench_events_main(int argc, char **argv)
{
    int json = 0, quick = 0, engine_only = 0, engine_inproc = 0;
    uint64_t engine_messages = 0;
    const char *trace_path = NULL;
    enum { OPT_JSON = 256, OPT_QUICK, OPT_TRACE, OPT_ENGINE_ONLY, OPT_INPROC, OPT_MESSAGES };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {"trace", required_argument, NULL, OPT_TRACE},
        {"engine-steps-only", no_argument, NULL, OPT_ENGINE_ONLY},
        {"inproc", no_argument, NULL, OPT_INPROC},
        {"messages", required_argument, NULL, OPT_MESSAGES},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "bench events");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            usage(stdout);
            return KM_EXIT_OK;
        case OPT_JSON:
            json = 1;
            break;
        case OPT_QUICK:
            quick = 1;
            break;
        case OPT_TRACE:
            trace_path = optarg;
            break;
        case OPT_ENGINE_ONLY:
            engine_only = 1;
            break;
        case OPT_INPROC:
            engine_inproc = 1;
            break;
        case OPT_MESSAGES:
            if (!km_cli_u64("bench events", "messages", optarg, 1, UINT64_C(1) << 32, &engine_messages))
                return KM_EXIT_USAGE;
            break;
        default:
            return km_cli_usage_error("bench events");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench events: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench events");
    }
    if (engine_only)
        return engine_steps_only(ENG_REPS,
                                 engine_messages ? engine_messages
                                 : quick         ? ENG_MESSAGES_QUICK
                                                 : ENG_MESSAGES,
                                 engine_inproc);
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
        if (run_inproc(&st, &v_in[r], NULL, &lost, &pairs)) {
            fprintf(stderr, "kvmatch bench events: inproc run failed\n");
            return 1;
        }
        lost_in += lost;
        pairs_in = pairs;
        if (run_zmq(&st, &v_zmq[r], &lost, &pairs, &se, NULL)) {
            fprintf(stderr, "kvmatch bench events: zmq run failed\n");
            return 1;
        }
        lost_zmq += lost;
        pairs_zmq = pairs;
        send_errors += se;
    }
    double s_in = km_bench_median(v_in, (size_t)reps), s_zmq = km_bench_median(v_zmq, (size_t)reps);

    /* The engine-shaped stream through the subscriber, alternating with the transport's floor on
     * the same messages, so both see the same machine. */
    stream es;
    if (build_engine_stream(quick ? ENG_MESSAGES_QUICK : ENG_MESSAGES, &es)) {
        fprintf(stderr, "kvmatch bench events: out of memory building the engine stream\n");
        return 1;
    }
    double v_steps[ENG_REPS], v_floor[ENG_REPS];
    json_t *engine_reps = json_array();
    uint64_t lost_steps = 0, lost_floor = 0, pairs_steps = 0, send_errors_steps = 0;
    for (int r = 0; r < ENG_REPS; r++) {
        uint64_t lost, se = 0;
        double rt_steps = km_bench_cpu_round_trip_ns();
        if (run_zmq(&es, &v_steps[r], &lost, &pairs_steps, &se, NULL)) {
            fprintf(stderr, "kvmatch bench events: engine_steps run failed\n");
            return 1;
        }
        lost_steps += lost;
        send_errors_steps += se;
        double rt_floor = km_bench_cpu_round_trip_ns();
        if (run_zmq_floor(&es, &v_floor[r], &lost)) {
            fprintf(stderr, "kvmatch bench events: zmq_floor run failed\n");
            return 1;
        }
        lost_floor += lost;
        json_array_append_new(
            engine_reps,
            json_pack("{s:f, s:f, s:f, s:f}", "engine_steps_messages_per_s",
                      km_bench_round_to((double)timed_msgs(&es) / v_steps[r], 1),
                      "engine_steps_cpu_round_trip_ns_before", km_bench_round_to(rt_steps, 1),
                      "zmq_floor_messages_per_s", km_bench_round_to((double)timed_msgs(&es) / v_floor[r], 1),
                      "zmq_floor_cpu_round_trip_ns_before", km_bench_round_to(rt_floor, 1)));
    }
    double s_steps = km_bench_median(v_steps, ENG_REPS);
    double s_floor = km_bench_median(v_floor, ENG_REPS);
    double mps_steps = (double)timed_msgs(&es) / s_steps, mps_floor = (double)timed_msgs(&es) / s_floor;
    double eps_steps = (double)timed_block_events(&es) / s_steps;
    double eps_floor = (double)timed_block_events(&es) / s_floor;

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
    /* argv[0] is "kvmatch bench events" (km_cli_getopt_begin); then the options as given. */
    char command[512] = "kvmatch bench events";
    for (int i = 1; i < argc; i++) {
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
        json_array_append_new(notes, json_string(
            "engine_steps: one message per simulated engine step (4-8 requests each storing 1-3 "
            "blocks, evictions once an engine holds its capacity, a rare AllBlocksCleared), engines "
            "interleaved, through the same publisher and km_subscriber as zmq; zmq_floor: the same "
            "messages received by one SUB per engine and dropped undecoded, alternating with "
            "engine_steps in the same run"));
        json_array_append_new(notes, json_sprintf(
            "restart: synthetic snapshot (chains of %u blocks, half shared by all %u workers) "
            "built through the feed in %.1f s; the file (%.0f MB) is in the page cache; ready = "
            "create index + feed, km_feed_restore (read, checksum, validate index and feed state, "
            "install), claim every worker (each asks for a replay from its saved seq + 1)",
            RS_CHAIN, RS_WORKERS, build_s, (double)file_bytes / 1e6));
        json_t *o = json_pack(
            "{s:s, s:o, s:o, s:o, s:o, s:o, s:{s:I, s:f, s:f, s:f, s:I, s:I}, s:{s:s, s:I, s:I, s:I, s:I, s:I, "
            "s:I, s:I, s:I, s:I, s:I, s:b}, s:o}",
            "command", command, "machine", machine,
            "results",
            json_pack("[{s:s, s:f, s:f, s:I, s:I}, {s:s, s:f, s:f, s:I, s:I, s:I}, "
                      "{s:s, s:f, s:f, s:f, s:I, s:I, s:I}, {s:s, s:f, s:f, s:f, s:I}]", "path",
                      "inproc", "block_events_per_s", km_bench_round_to(eps_in, 1), "seconds",
                      km_bench_round_to(s_in, 0.0001), "lost_or_unmatched", (json_int_t)lost_in,
                      "pairs_after", (json_int_t)pairs_in, "path", "zmq", "block_events_per_s",
                      km_bench_round_to(eps_zmq, 1), "seconds", km_bench_round_to(s_zmq, 0.0001), "dropped",
                      (json_int_t)lost_zmq, "send_errors", (json_int_t)send_errors, "pairs_after",
                      (json_int_t)pairs_zmq,
                      "path", "engine_steps", "messages_per_s", km_bench_round_to(mps_steps, 1),
                      "block_events_per_s", km_bench_round_to(eps_steps, 1),
                      "seconds", km_bench_round_to(s_steps, 0.0001), "dropped", (json_int_t)lost_steps,
                      "send_errors", (json_int_t)send_errors_steps, "pairs_after",
                      (json_int_t)pairs_steps,
                      "path", "zmq_floor", "messages_per_s", km_bench_round_to(mps_floor, 1),
                      "block_events_per_s", km_bench_round_to(eps_floor, 1),
                      "seconds", km_bench_round_to(s_floor, 0.0001), "dropped", (json_int_t)lost_floor),
            "targets", json_pack("{s:f, s:f, s:f, s:f}", "block_events_per_s", 2e6, "ready_s", 2.0,
                                 "engine_messages_per_s", 1e5, "engine_floor_fraction", 0.5),
            "engine_stream", json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
                                       "engines", (json_int_t)ENG_ENGINES, "capacity_blocks",
                                       (json_int_t)ENG_CAPACITY, "messages", (json_int_t)es.n_msgs,
                                       "warmup_messages", (json_int_t)es.warm_msgs,
                                       "timed_messages", (json_int_t)timed_msgs(&es),
                                       "timed_block_events", (json_int_t)timed_block_events(&es),
                                       "block_events", (json_int_t)es.block_events, "stored_blocks",
                                       (json_int_t)es.stored_blocks, "removed_blocks",
                                       (json_int_t)es.removed_blocks, "clears",
                                       (json_int_t)es.clears, "bytes", (json_int_t)es.size),
            "engine_reps", engine_reps,
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
        json_decref(engine_reps);
        printf("kvmatch bench events: %" PRIu64 " block events in %zu messages (%" PRIu64
               " stored, %" PRIu64 " removed), %d reps\n",
               st.block_events, st.n_msgs, st.stored_blocks, st.removed_blocks, reps);
        printf("  inproc  %12.0f block events/s  (%.3f s, %" PRIu64 " lost)\n", eps_in, s_in, lost_in);
        printf("  zmq     %12.0f block events/s  (%.3f s, %" PRIu64 " dropped)\n", eps_zmq, s_zmq,
               lost_zmq);
        printf("  engine steps: %zu messages from %u engines, %" PRIu64 " block events (%" PRIu64
               " stored, %" PRIu64 " removed, %" PRIu64 " clears); timed: the last %zu after the "
               "warm-up\n",
               es.n_msgs, ENG_ENGINES, es.block_events, es.stored_blocks, es.removed_blocks, es.clears,
               timed_msgs(&es));
        printf("  engine_steps %10.0f messages/s %12.0f block events/s  (%.3f s, %" PRIu64
               " dropped)\n", mps_steps, eps_steps, s_steps, lost_steps);
        printf("  zmq_floor    %10.0f messages/s %12.0f block events/s  (%.3f s, %" PRIu64
               " dropped)\n", mps_floor, eps_floor, s_floor, lost_floor);
        printf("  restart %" PRIu64 " pairs: ready in %.3f s (km_bench_median of %d; index load %.3f s, "
               "feed state %.3f s)\n", saved_pairs, ready, restart_reps, load_s, import_s);
    }
    stream_free(&st);
    stream_free(&es);
    return 0;
}
