/* SPDX-License-Identifier: Apache-2.0 */
/* What vLLM's and SGLang's own code published (tests/engine_fixtures/, written by
 * scripts/check-engines.py from the engines' wheels; the format is in its docstring), replayed
 * through a feed as a transport would deliver it:
 *  - engine runs: vLLM's KVCacheManager served prompts and its ZmqEventPublisher published the
 *    events; before each prompt the feed has applied every message the engine published before
 *    it, and the worker's matched depth, capped as an engine caps a hit (the prompt's last token is
 *    always recomputed), must equal the engine's own prefix-cache hit. Gaps are answered with the
 *    publisher's own replay answers, and the feed's state and lost count are checked where the
 *    fixture states them. Covers plain and lookahead hashing, DP ranks, gaps inside and beyond
 *    the replay buffer, a prefix-cache reset and an engine restart, second copies of a block
 *    (each evicted on its own), requests with a cache salt
 *    or a LoRA adapter (routed with the same salt and adapter name), and hybrid models (a
 *    full-attention group with one or two sliding-window groups, or a Mamba group); SGLang's
 *    RadixCache served prompts, plain and in salted and LoRA namespaces, and its KV-event
 *    recorder's events were encoded with SGLang's own KVEventBatch. vLLM's KVCacheManager with
 *    its OffloadingConnector's CPU tier: the engine's hit is its GPU hit, then the connector's
 *    CPU hit from there, and kvmatch's depth and tier split, read under the connector's chunk
 *    rule (predicted_hit), must give the hit and its host part; SGLang's UnifiedRadixCache with
 *    its host tier (HiCache): the device hit, then the host blocks it loads back when they reach
 *    its load-back threshold. A prompt marked "bound" must only not exceed the engine's hit; how
 *    often it equals it is logged.
 *  - event encodings: the worker's index must end with exactly the expected chains, each in its
 *    tier (lookahead variants, LoRA under Dynamo's seed rule with a CPU offload, the cache salt in
 *    vLLM's extra keys and as SGLang's own field, SGLang's CPU_PINNED and EXTERNAL media).
 * No event may be refused, except as a fixture's `refused` lines say and stores whose parent was
 * in messages lost beyond the replay buffer. A hybrid model's groups caching blocks through
 * vLLM's BlockPool (a full-attention and a Mamba group that keeps some blocks' states) leave only
 * the blocks every group is known to hold. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "test_util.h"

#define FIXTURE_DIR "tests/engine_fixtures"
#define MAX_WORKERS 4
#define MAX_REPLAYS 16
#define MAX_PROMPT_TOKENS 4096

typedef struct recorded_replay {
    uint32_t worker;
    uint64_t start_seq;
    uint32_t n_items;
    uint64_t *seqs;
    char **hex; /* one payload each, as hex */
    bool used;
} recorded_replay;

typedef struct fixture_run {
    const char *path;
    unsigned line_no;
    km_index *index;
    km_feed *feed;
    km_kv_decoder *dec;
    uint32_t block_size, lookahead;
    uint64_t now;
    recorded_replay replays[MAX_REPLAYS];
    uint32_t n_replays;
    unsigned prompts_exact, prompts_unseen, replays_served;
    unsigned prompts_bound, bound_equal, bound_blocks_short;
    unsigned prompts_host; /* exact prompts whose engine hit came partly from the host tier */
    uint32_t host_chunk_blocks[MAX_WORKERS]; /* 0, or the blocks per chunk of its host tier */
    /* 0, or the fewest host blocks SGLang's HiCache loads back (load_back_threshold) */
    uint32_t host_load_min_blocks[MAX_WORKERS];
} fixture_run;

static size_t unhex(const char *hex, unsigned char *out, size_t cap)
{
    size_t n = 0;
    for (; hex[0] && hex[1] && hex[0] != '\n' && n < cap; hex += 2) {
        unsigned v;
        cr_assert_eq(sscanf(hex, "%2x", &v), 1, "bad hex");
        out[n++] = (unsigned char)v;
    }
    cr_assert(!hex[0] || hex[0] == '\n', "payload over %zu bytes", cap);
    return n;
}

static const km_kv_batch *decode(fixture_run *r, const char *hex, uint64_t seq)
{
    static unsigned char payload[1 << 16];
    static km_kv_batch b;
    size_t n = unhex(hex, payload, sizeof payload);
    int rc = km_kv_decode_payload(r->dec, payload, n, &b);
    cr_assert_eq(rc, KM_OK, "%s:%u seq %llu: %s", r->path, r->line_no, (unsigned long long)seq,
                 km_kv_decoder_last_error(r->dec));
    cr_assert_eq(b.n_rejected, 0, "%s:%u seq %llu: %s", r->path, r->line_no,
                 (unsigned long long)seq, b.n_rejected ? b.rejected[0].message : "");
    return &b;
}

/* Answer the feed's replay requests with the publisher's recorded answers. */
static void serve_actions(fixture_run *r)
{
    km_feed_action a;
    while (km_feed_next_action(r->feed, &a)) {
        if (a.kind != KM_FEED_ACTION_REPLAY_REQUEST)
            continue;
        recorded_replay *rep = NULL;
        for (uint32_t i = 0; i < r->n_replays && !rep; i++)
            if (!r->replays[i].used && r->replays[i].worker == a.worker &&
                r->replays[i].start_seq == a.start_seq)
                rep = &r->replays[i];
        cr_assert_not_null(rep, "%s:%u: the feed asked worker %u for a replay from seq %llu, "
                           "which the engine run did not record",
                           r->path, r->line_no, a.worker, (unsigned long long)a.start_seq);
        rep->used = true;
        for (uint32_t i = 0; i < rep->n_items; i++)
            cr_assert_eq(km_feed_replay_item(r->feed, a.worker, a.request_id, rep->seqs[i],
                                             decode(r, rep->hex[i], rep->seqs[i]), r->now++),
                         KM_OK);
        cr_assert_eq(km_feed_replay_end(r->feed, a.worker, a.request_id, r->now++), KM_OK);
        r->replays_served++;
    }
}

/* The worker's matched depth for the prompt (a route's `depth`) and its tier split, over the
 * request's first n_blocks blocks. */
static uint32_t matched_depth(fixture_run *r, uint32_t worker, const uint64_t *chains,
                              size_t n_blocks, km_match_tiers *tiers)
{
    uint32_t depth = 0;
    *tiers = (km_match_tiers){0, 0};
    if (!n_blocks)
        return 0;
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {chains, (uint32_t)n_blocks};
    cr_assert_eq(km_index_match_batch(r->index, &q, 1, &res), KM_OK);
    for (uint32_t i = 0; i < res.requests[0].count; i++)
        if (res.matches[res.requests[0].first + i].worker == worker) {
            depth = res.matches[res.requests[0].first + i].depth;
            *tiers = res.tiers[res.requests[0].first + i];
        }
    km_match_results_free(&res);
    return depth;
}

/* The engine's hit as kvmatch predicts it, in blocks, with the part of it in host memory.
 * The engine recomputes the prompt's last token, so it never counts the blocks from the one
 * holding that token (cap). Without a host tier the prediction is the worker's depth over the
 * blocks before the cap (a hybrid model's sliding-window groups are looked at below that cap,
 * as the engine does). With vLLM's OffloadingConnector storing chunks of `chunk` blocks in host
 * memory, the engine hits its device prefix (the depth's device blocks, which lead it, capped),
 * then loads whole chunks from host memory from there on (a chunk is keyed by its last block,
 * so a block held in host memory inside a chunk whose later blocks differ does not load): the
 * depth over the prompt's full blocks cut to a chunk boundary, when that passes the device hit
 * by a chunk's worth of blocks at least (the connector loads no less), then capped. With
 * SGLang's HiCache, the engine hits its device prefix (the depth's device blocks, which lead it:
 * SGLang evicts a node from the device only once its children have left it) and loads the
 * host-only blocks after it when they are at least its load-back threshold
 * (host_load_min_blocks), else none of them, all below the cap. */
static uint32_t predicted_hit(fixture_run *r, uint32_t worker, const char *salt, const char *lora,
                              const uint32_t *tokens, size_t n, uint32_t *host_blocks)
{
    static uint64_t chains[MAX_PROMPT_TOKENS];
    size_t n_blocks = 0;
    km_hash_config hc = {r->block_size, lora, salt};
    cr_assert_eq(km_hash_sequence_lookahead(&hc, r->lookahead, tokens, n, 0, 0, NULL, chains,
                                            &n_blocks),
                 KM_OK);
    uint32_t cap = n ? (uint32_t)((n - 1) / r->block_size) : 0;
    km_match_tiers tiers;
    uint32_t chunk = r->host_chunk_blocks[worker];
    if (!chunk) {
        uint32_t depth = matched_depth(r, worker, chains, n_blocks < cap ? n_blocks : cap, &tiers);
        *host_blocks = tiers.host_blocks;
        if (tiers.host_blocks && tiers.host_blocks < r->host_load_min_blocks[worker]) {
            *host_blocks = 0; /* too few to load back: recomputed */
            return depth - tiers.host_blocks;
        }
        return depth;
    }
    uint32_t depth = matched_depth(r, worker, chains, n_blocks, &tiers);
    cr_assert_eq(tiers.disk_blocks, 0, "%s:%u: a disk tier", r->path, r->line_no);
    uint32_t device = depth - tiers.host_blocks;
    uint32_t hit = device < cap ? device : cap; /* the device prefix hit, capped */
    uint32_t loaded_to = depth / chunk * chunk;
    if (tiers.host_blocks && loaded_to >= hit + chunk)
        hit = loaded_to; /* the connector loads at least one chunk's worth, or nothing */
    if (hit > cap)
        hit = cap;
    *host_blocks = hit - (device < hit ? device : hit);
    return hit;
}

static void check_prompt(fixture_run *r, char *rest)
{
    static uint32_t tokens[MAX_PROMPT_TOKENS];
    unsigned worker, hit;
    char check[16];
    int used = 0;
    cr_assert_eq(sscanf(rest, "%u %u %15s %n", &worker, &hit, check, &used), 3, "%s:%u", r->path,
                 r->line_no);
    /* The request's cache salt and LoRA adapter, as a router would send them in the route, and
     * how many blocks of the engine's hit came from its host tier (a KV connector's CPU hit). */
    static char salt[64], lora[64], host[64];
    salt[0] = lora[0] = host[0] = '\0';
    for (int more = 0; !strncmp(rest + used, "salt=", 5) || !strncmp(rest + used, "lora=", 5) ||
                       !strncmp(rest + used, "host=", 5);
         used += more) {
        char *value = rest[used] == 's' ? salt : rest[used] == 'l' ? lora : host;
        cr_assert_eq(sscanf(rest + used + 5, "%63s %n", value, &more), 1, "%s:%u", r->path,
                     r->line_no);
        more += 5;
    }
    size_t n = 0;
    for (char *t = strtok(rest + used, ",\n"); t; t = strtok(NULL, ",\n")) {
        cr_assert_lt(n, MAX_PROMPT_TOKENS);
        tokens[n++] = (uint32_t)strtoul(t, NULL, 10);
    }
    cr_assert_eq(km_feed_flush(r->feed, r->now++, NULL), KM_OK);
    uint32_t predicted_host;
    uint32_t predicted = predicted_hit(r, worker, salt, lora, tokens, n, &predicted_host);
    if (!strcmp(check, "unseen")) {
        r->prompts_unseen++;
        return;
    }
    if (!strcmp(check, "bound")) {
        cr_assert_leq(predicted, hit,
                      "%s:%u: worker %u, a prompt of %zu tokens: kvmatch predicts a hit of %u "
                      "blocks, above the engine's %u",
                      r->path, r->line_no, worker, n, predicted, hit);
        r->prompts_bound++;
        r->bound_equal += predicted == hit;
        r->bound_blocks_short += hit - predicted;
        return;
    }
    cr_assert_str_eq(check, "exact", "%s:%u", r->path, r->line_no);
    cr_assert_eq(predicted, hit,
                 "%s:%u: worker %u, a prompt of %zu tokens (salt \"%s\", adapter \"%s\"): "
                 "kvmatch predicts a hit of %u blocks, the engine hit %u",
                 r->path, r->line_no, worker, n, salt, lora, predicted, hit);
    if (host[0]) {
        /* The engine's hit is its device prefix hit, then the connector's host continuation:
         * kvmatch's tier split must say as much. */
        unsigned host_blocks = (unsigned)strtoul(host, NULL, 10);
        cr_assert_eq(predicted_host, host_blocks,
                     "%s:%u: worker %u, a prompt of %zu tokens: kvmatch places %u of its %u "
                     "blocks in host memory, the engine hit %u there",
                     r->path, r->line_no, worker, n, predicted_host, predicted, host_blocks);
        r->prompts_host += host_blocks > 0;
    }
    r->prompts_exact++;
}

static void check_state(fixture_run *r, const char *rest)
{
    unsigned worker;
    char state[16];
    unsigned long long lost;
    cr_assert_eq(sscanf(rest, "%u %15s %llu", &worker, state, &lost), 3);
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(r->feed, worker, &info), KM_OK);
    cr_assert_str_eq(km_feed_state_name(info.state), state, "%s:%u: worker %u", r->path,
                     r->line_no, worker);
    cr_assert_eq(info.counters.lost, lost, "%s:%u: worker %u lost %llu, expected %llu", r->path,
                 r->line_no, worker, (unsigned long long)info.counters.lost, lost);
}

static char *read_line(FILE *f)
{
    static char *line;
    static size_t cap;
    return getline(&line, &cap, f) > 0 ? line : NULL;
}

static void run_fixture(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    fixture_run r = {.path = path, .now = 1000};
    r.index = km_test_make_index(MAX_WORKERS);
    cr_assert_eq(km_kv_decoder_create(NULL, &r.dec), KM_OK);
    uint64_t expect[16], seq = 0;
    uint32_t tiers[16], n_expect = 0;
    bool workers[MAX_WORKERS] = {false}, engine_run = false;
    uint64_t refused_expected[KM_FEED_REFUSAL_COUNT] = {0};
    char *line;
    while ((line = read_line(f))) {
        r.line_no++;
        if (!strncmp(line, "config ", 7)) {
            km_feed_config cfg;
            unsigned chunk = 1;
            cr_assert_geq(sscanf(line + 7, "%u %u %u", &r.block_size, &r.lookahead, &chunk), 2);
            km_test_feed_config(&cfg, r.block_size);
            cfg.hash_lookahead_tokens = r.lookahead;
            cfg.offload_chunk_blocks = chunk; /* the engines' placeholder chunks */
            /* Replays are asked for gaps only: the engine run records no bootstrap answer. */
            cfg.bootstrap_replay = false;
            cr_assert_eq(km_feed_create(r.index, &cfg, &r.feed), KM_OK);
        } else if (!strncmp(line, "worker ", 7)) {
            unsigned w, replay;
            cr_assert_eq(sscanf(line + 7, "%u %u", &w, &replay), 2);
            cr_assert_lt(w, MAX_WORKERS);
            km_feed_worker_config wc = {w, "engine", replay != 0};
            cr_assert_eq(km_feed_add_worker(r.feed, &wc, r.now++), KM_OK);
            workers[w] = engine_run = true;
        } else if (!strncmp(line, "offload ", 8)) {
            unsigned w, chunk;
            cr_assert_eq(sscanf(line + 8, "%u %u", &w, &chunk), 2);
            cr_assert(w < MAX_WORKERS && workers[w] && chunk > 0, "%s:%u", path, r.line_no);
            r.host_chunk_blocks[w] = chunk;
        } else if (!strncmp(line, "hicache ", 8)) {
            unsigned w, min_blocks;
            cr_assert_eq(sscanf(line + 8, "%u %u", &w, &min_blocks), 2);
            cr_assert(w < MAX_WORKERS && workers[w] && min_blocks > 0, "%s:%u", path, r.line_no);
            r.host_load_min_blocks[w] = min_blocks;
        } else if (!strncmp(line, "live ", 5)) {
            unsigned w;
            unsigned long long s;
            int used = 0;
            cr_assert_eq(sscanf(line + 5, "%u %llu %n", &w, &s, &used), 2);
            cr_assert(w < MAX_WORKERS && workers[w], "%s:%u: unknown worker", path, r.line_no);
            cr_assert_eq(km_feed_live(r.feed, w, s, decode(&r, line + 5 + used, s), r.now++),
                         KM_OK);
            serve_actions(&r);
        } else if (!strncmp(line, "replay ", 7)) {
            cr_assert_lt(r.n_replays, MAX_REPLAYS);
            recorded_replay *rep = &r.replays[r.n_replays++];
            unsigned long long start;
            cr_assert_eq(sscanf(line + 7, "%u %llu %u", &rep->worker, &start, &rep->n_items), 3);
            rep->start_seq = start;
            rep->seqs = calloc(rep->n_items + 1, sizeof *rep->seqs);
            rep->hex = calloc(rep->n_items + 1, sizeof *rep->hex);
            for (uint32_t i = 0; i < rep->n_items; i++) {
                cr_assert_not_null(line = read_line(f));
                r.line_no++;
                unsigned long long s;
                int used = 0;
                cr_assert_eq(sscanf(line, "item %llu %n", &s, &used), 1, "%s:%u", path,
                             r.line_no);
                rep->seqs[i] = s;
                rep->hex[i] = strdup(line + used);
            }
        } else if (!strncmp(line, "prompt ", 7)) {
            check_prompt(&r, line + 7);
        } else if (!strncmp(line, "state ", 6)) {
            cr_assert_eq(km_feed_flush(r.feed, r.now++, NULL), KM_OK);
            check_state(&r, line + 6);
        } else if (!strncmp(line, "payload ", 8)) {
            /* An event encoding: one worker fed from seq 0. */
            if (!workers[0]) {
                km_feed_worker_config wc = {0, "engine", false};
                cr_assert_eq(km_feed_add_worker(r.feed, &wc, r.now++), KM_OK);
                workers[0] = true;
            }
            cr_assert_eq(km_feed_live(r.feed, 0, seq, decode(&r, line + 8, seq), r.now++), KM_OK);
            seq++;
        } else if (!strncmp(line, "expect ", 7)) {
            char tier[16];
            unsigned long long chain;
            cr_assert_eq(sscanf(line + 7, "%llx %15s", &chain, tier), 2);
            cr_assert_lt(n_expect, 16);
            expect[n_expect] = chain;
            tiers[n_expect++] = !strcmp(tier, "host") ? KM_TIER_HOST
                                : !strcmp(tier, "disk") ? KM_TIER_DISK
                                                        : KM_TIER_DEVICE;
        } else if (!strncmp(line, "refused ", 8)) {
            char reason[32];
            unsigned long long count;
            cr_assert_eq(sscanf(line + 8, "%31s %llu", reason, &count), 2);
            unsigned k = 0;
            while (k < KM_FEED_REFUSAL_COUNT &&
                   strcmp(km_feed_refusal_name((km_feed_refusal)k), reason))
                k++;
            cr_assert_lt(k, KM_FEED_REFUSAL_COUNT, "%s:%u: no reason %s", path, r.line_no, reason);
            refused_expected[k] = count;
        } else {
            cr_assert(line[0] == '#' || line[0] == '\n', "%s:%u: unknown line", path, r.line_no);
        }
    }
    fclose(f);
    cr_assert_not_null(r.feed, "%s: no config line", path);
    cr_assert_eq(km_feed_flush(r.feed, r.now++, NULL), KM_OK);
    if (engine_run) {
        cr_assert_gt(r.prompts_exact + r.prompts_bound, 0, "%s: no prompt compared", path);
        for (uint32_t i = 0; i < r.n_replays; i++)
            cr_assert(r.replays[i].used, "%s: the replay from seq %llu was never asked for", path,
                      (unsigned long long)r.replays[i].start_seq);
    } else {
        char why[256];
        cr_assert(km_test_index_holds_exactly(r.index, 0, expect, n_expect, why, sizeof why),
                  "%s: %s", path, why);
        for (uint32_t i = 0; i < n_expect; i++) {
            km_match_results res;
            km_match_results_init(&res);
            km_request q = {&expect[i], 1};
            cr_assert_eq(km_index_match_batch(r.index, &q, 1, &res), KM_OK);
            cr_assert_eq(res.requests[0].count, 1);
            uint32_t got = res.tiers[0].host_blocks   ? KM_TIER_HOST
                           : res.tiers[0].disk_blocks ? KM_TIER_DISK
                                                      : KM_TIER_DEVICE;
            cr_assert_eq(got, tiers[i], "%s: chain %u in tier %u, expected %u", path, i, got,
                         tiers[i]);
            km_match_results_free(&res);
        }
    }
    for (uint32_t w = 0; w < MAX_WORKERS; w++) {
        if (!workers[w])
            continue;
        km_feed_worker_info info;
        cr_assert_eq(km_feed_get_worker_info(r.feed, w, &info), KM_OK);
        for (unsigned k = 0; k < KM_FEED_REFUSAL_COUNT; k++) {
            /* Stores continuing blocks stored in lost messages have an unknown parent. */
            if (k == KM_FEED_REFUSED_UNKNOWN_PARENT && info.counters.lost > 0)
                continue;
            cr_assert_eq(info.counters.refused[k], refused_expected[k],
                         "%s: worker %u: %s refused %llu times, expected %llu", path, w,
                         km_feed_refusal_name((km_feed_refusal)k),
                         (unsigned long long)info.counters.refused[k],
                         (unsigned long long)refused_expected[k]);
        }
    }
    if (engine_run)
        cr_log_info("%s: %u prompts equal to the engine's hit (%u of them partly from its host "
                    "tier); %u at most the engine's hit (%u equal, %u blocks short in all); %u not "
                    "compared; %u replays",
                    path, r.prompts_exact, r.prompts_host, r.prompts_bound, r.bound_equal,
                    r.bound_blocks_short, r.prompts_unseen, r.replays_served);
    for (uint32_t i = 0; i < r.n_replays; i++) {
        for (uint32_t j = 0; j < r.replays[i].n_items; j++)
            free(r.replays[i].hex[j]);
        free(r.replays[i].hex);
        free(r.replays[i].seqs);
    }
    km_feed_destroy(r.feed);
    km_kv_decoder_destroy(r.dec);
    km_index_destroy(r.index);
}

Test(engine_fixtures, engines_own_runs_and_encodings_give_the_engines_hits, .timeout = 60)
{
    DIR *d = opendir(FIXTURE_DIR);
    cr_assert_not_null(d, "%s missing (run from the repository root)", FIXTURE_DIR);
    unsigned n = 0, engine_runs = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".txt"))
            continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", FIXTURE_DIR, e->d_name);
        run_fixture(path);
        n++;
        engine_runs += !strncmp(e->d_name, "vllm_engine_", 12);
    }
    closedir(d);
    cr_assert_geq(n, 11, "only %u fixtures", n);
    cr_assert_geq(engine_runs, 6, "only %u engine runs", engine_runs);
}
