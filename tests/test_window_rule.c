/* Window rules (km_index_set_worker_windows): a hybrid model's sliding-window groups bound a
 * worker's matched depth as vLLM's HybridKVCacheCoordinator bounds its hit. Random states (blocks
 * of a prefix tree held by the full-attention side and by window groups, each held or not at
 * random, so windows have holes anywhere) are scored and compared with a brute-force statement of
 * the rule: from the plain prefix depth d, the largest e <= d at which every window group holds
 * the blocks [max(0, e - blocks), e). Entries, owners and depths must equal it; workers without a
 * rule keep their plain depth. The same on the CUDA backend, where a device exists (skipped
 * without one; failed instead under KM_REQUIRE_CUDA=1). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/hash.h"
#include "kvmatch/index.h"
#include "test_util.h"

#define NODES 160
#define WORKERS 6
#define TAGS 4
#define MAX_PATH NODES

typedef struct tree {
    int parent[NODES]; /* -1: a root */
    uint64_t chain[NODES];
} tree;

typedef struct state {
    bool full[WORKERS][NODES];            /* the full-attention side holds the block */
    bool window[WORKERS][TAGS][NODES];    /* window group `tag` holds the block */
    uint32_t n_groups[WORKERS];
    km_window_group groups[WORKERS][KM_MAX_WINDOW_GROUPS];
} state;

static void make_tree(tree *t, km_rng *r)
{
    for (int k = 0; k < NODES; k++) {
        /* Mostly long chains, with branches from anywhere earlier and a few roots. */
        t->parent[k] = k == 0 || km_rng_percent(r, 4) ? -1
                       : km_rng_percent(r, 80)         ? k - 1
                                                        : (int)km_rng_below(r, (uint32_t)k);
        uint64_t local = km_rng_hash(r);
        t->chain[k] = t->parent[k] < 0 ? km_hash_chain_root(local)
                                       : km_hash_chain_step(t->chain[t->parent[k]], local);
    }
}

/* The nodes from a root to `node`, root first. */
static uint32_t path_to(const tree *t, int node, int *path)
{
    uint32_t n = 0;
    for (int k = node; k >= 0; k = t->parent[k])
        path[n++] = k;
    for (uint32_t i = 0; i < n / 2; i++) {
        int x = path[i];
        path[i] = path[n - 1 - i];
        path[n - 1 - i] = x;
    }
    return n;
}

static void apply_one(km_index *index, km_update_kind kind, uint32_t w, uint64_t parent,
                      uint64_t key)
{
    km_update u = {kind, w, parent, &key, 1, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "%s", km_index_last_error(index));
}

/* Flip each pair with probability `percent`, in the state and the index. */
static void mutate(km_index *index, const tree *t, state *s, km_rng *r, uint32_t percent)
{
    for (uint32_t w = 0; w < WORKERS; w++)
        for (int k = 0; k < NODES; k++) {
            if (km_rng_percent(r, percent)) {
                s->full[w][k] = !s->full[w][k];
                uint64_t parent = t->parent[k] < 0 ? KM_NO_PARENT : t->chain[t->parent[k]];
                apply_one(index, s->full[w][k] ? KM_UPDATE_STORE : KM_UPDATE_REMOVE, w, parent,
                          t->chain[k]);
            }
            for (uint32_t g = 0; g < TAGS; g++)
                if (km_rng_percent(r, percent)) {
                    s->window[w][g][k] = !s->window[w][g][k];
                    apply_one(index, s->window[w][g][k] ? KM_UPDATE_STORE : KM_UPDATE_REMOVE, w,
                              KM_NO_PARENT, km_hash_window_key(t->chain[k], g));
                }
        }
}

static void set_rules(km_index *index, state *s, km_rng *r)
{
    for (uint32_t w = 0; w < WORKERS; w++) {
        uint32_t n = km_rng_percent(r, 30) ? 0 : 1 + km_rng_below(r, 3);
        for (uint32_t g = 0; g < n; g++) {
            s->groups[w][g].group = km_rng_below(r, TAGS);
            s->groups[w][g].blocks = 1 + km_rng_below(r, 4);
        }
        s->n_groups[w] = n;
        cr_assert_eq(km_index_set_worker_windows(index, w, s->groups[w], n), KM_OK);
    }
}

/* The rule as stated, by brute force. */
static uint32_t oracle_depth(const state *s, uint32_t w, const int *path, uint32_t n)
{
    uint32_t d = 0;
    while (d < n && s->full[w][path[d]])
        d++;
    for (uint32_t e = d;; e--) {
        bool ok = true;
        for (uint32_t g = 0; g < s->n_groups[w] && ok; g++) {
            uint32_t b = s->groups[w][g].blocks, tag = s->groups[w][g].group;
            for (uint32_t i = e > b ? e - b : 0; i < e && ok; i++)
                ok = s->window[w][tag][path[i]];
        }
        if (ok) /* always at e == 0 */
            return e;
    }
}

static void check_batch(km_index *index, const tree *t, const state *s, km_rng *r)
{
    enum { BATCH = 48 };
    static int paths[BATCH][MAX_PATH];
    static uint64_t hashes[BATCH][MAX_PATH];
    km_request reqs[BATCH];
    uint32_t lens[BATCH];
    for (uint32_t q = 0; q < BATCH; q++) {
        lens[q] = path_to(t, (int)km_rng_below(r, NODES), paths[q]);
        for (uint32_t i = 0; i < lens[q]; i++)
            hashes[q][i] = t->chain[paths[q][i]];
        reqs[q] = (km_request){hashes[q], lens[q]};
    }
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, reqs, BATCH, &res), KM_OK);
    uint64_t expected_entries = 0;
    for (uint32_t q = 0; q < BATCH; q++) {
        const km_request_result *rr = &res.requests[q];
        uint32_t owner = KM_NO_WORKER, owner_depth = 0, j = 0;
        for (uint32_t w = 0; w < WORKERS; w++) {
            uint32_t want = oracle_depth(s, w, paths[q], lens[q]);
            if (!want)
                continue;
            cr_assert_lt(j, rr->count, "request %u: worker %u (depth %u) missing", q, w, want);
            const km_worker_match *m = &res.matches[rr->first + j++];
            cr_assert_eq(m->worker, w, "request %u: entry %u is worker %u, expected %u", q, j - 1,
                         m->worker, w);
            cr_assert_eq(m->depth, want, "request %u of %u blocks, worker %u (%u window groups): "
                         "depth %u, the rule gives %u", q, lens[q], w, s->n_groups[w], m->depth,
                         want);
            if (want > owner_depth) {
                owner = w;
                owner_depth = want;
            }
        }
        cr_assert_eq(rr->count, j, "request %u: %u entries, expected %u", q, rr->count, j);
        cr_assert_eq(rr->owner, owner, "request %u: owner", q);
        cr_assert_eq(rr->owner_depth, owner_depth, "request %u: owner depth", q);
        expected_entries += j;
    }
    cr_assert_eq(res.n_matches, expected_entries);
    km_match_results_free(&res);
}

static km_index *make_index_on(km_backend_kind backend, uint32_t segment_blocks)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = backend;
    cfg.max_workers = WORKERS;
    cfg.segment_blocks = segment_blocks;
    cfg.threads = 2;
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    if (rc == KM_ERR_BACKEND_UNAVAILABLE && backend == KM_BACKEND_CUDA) {
        const char *required = getenv("KM_REQUIRE_CUDA");
        if (required && !strcmp(required, "1"))
            cr_assert_fail("KM_REQUIRE_CUDA=1 and no usable CUDA device");
        cr_skip_test("no usable CUDA device: %s", km_error_name(rc));
    }
    cr_assert_eq(rc, KM_OK, "%s", km_error_name(rc));
    return index;
}

static km_index *make_index(uint32_t segment_blocks)
{
    return make_index_on(KM_BACKEND_CPU, segment_blocks);
}

/* On a CUDA index every batch must have been scored by the device: after a fallback to the CPU
 * backend, or a batch scored on the host, the host's results would pass for the device's. The
 * tables here stay far below the size that grows incrementally (a growth finishes in its insert),
 * so no batch finds one growing, the one reason to score on the host. */
static void check_scored_on(km_index *index, km_backend_kind backend)
{
    if (backend != KM_BACKEND_CUDA)
        return;
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(index, &st), KM_OK);
    cr_assert_str_eq(km_index_backend_name(index), "cuda", "the CUDA index fell back to %s",
                     km_index_backend_name(index));
    cr_assert_eq(st.host_scored_batches, 0, "the CUDA index scored %" PRIu64 " batches on the host",
                 st.host_scored_batches);
}

static void random_states(km_backend_kind backend)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static const uint32_t segment_sizes[] = {0, 4};
    for (uint32_t round = 0; round < 8; round++) {
        km_index *index = make_index_on(backend, segment_sizes[round % 2]);
        static tree t;
        static state s;
        memset(&s, 0, sizeof s);
        make_tree(&t, &r);
        /* Dense holdings first (long prefixes, windows mostly whole), then holes everywhere. */
        uint32_t density = 60 + km_rng_below(&r, 40);
        mutate(index, &t, &s, &r, density);
        for (uint32_t step = 0; step < 6; step++) {
            set_rules(index, &s, &r);
            check_batch(index, &t, &s, &r);
            mutate(index, &t, &s, &r, 3 + km_rng_below(&r, 12));
        }
        /* Rules taken away: every worker is back to its plain prefix depth. */
        for (uint32_t w = 0; w < WORKERS; w++) {
            s.n_groups[w] = 0;
            cr_assert_eq(km_index_set_worker_windows(index, w, NULL, 0), KM_OK);
        }
        check_batch(index, &t, &s, &r);
        check_scored_on(index, backend);
        km_index_destroy(index);
    }
}

Test(window_rule, random_hybrid_states_match_the_rule_by_brute_force, .timeout = 60)
{
    random_states(KM_BACKEND_CPU);
}

/* In the cuda suite, which scripts/gpu-check.sh runs on a device. */
Test(cuda, window_rules_match_the_rule_on_random_hybrid_states, .timeout = 120)
{
    random_states(KM_BACKEND_CUDA);
}

Test(window_rule, a_lookup_per_block_scanned_is_counted_in_probes, .timeout = 30)
{
    km_index *index = make_index(0);
    uint64_t chain[6];
    for (uint32_t i = 0; i < 6; i++)
        chain[i] = i ? km_hash_chain_step(chain[i - 1], 100 + i) : km_hash_chain_root(100);
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, chain, 6), KM_OK);
    /* Window group 3 holds blocks 0, 1 and 3: with 2 blocks needed, the scan looks up blocks 5
     * down to 0 (6 lookups) and ends at the run [0, 2). */
    for (uint32_t i = 0; i < 6; i++)
        if (i == 0 || i == 1 || i == 3) {
            uint64_t key = km_hash_window_key(chain[i], 3);
            cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, &key, 1), KM_OK);
        }
    km_request q = {chain, 6};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    uint32_t plain_probes = res.requests[0].probes;
    cr_assert_eq(res.requests[0].owner_depth, 6);
    km_window_group g = {3, 2};
    cr_assert_eq(km_index_set_worker_windows(index, 0, &g, 1), KM_OK);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner_depth, 2);
    cr_assert_eq(res.requests[0].probes, plain_probes + 6);
    cr_assert_eq(res.probes, plain_probes + 6);
    /* One block needed: block 3 ends the scan at depth 4 after 3 lookups (5, 4, 3). */
    g.blocks = 1;
    cr_assert_eq(km_index_set_worker_windows(index, 0, &g, 1), KM_OK);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner_depth, 4);
    cr_assert_eq(res.requests[0].probes, plain_probes + 3);
    km_match_results_free(&res);
    km_index_destroy(index);
}

Test(window_rule, bad_rules_are_refused_and_change_nothing, .timeout = 30)
{
    km_index *index = make_index(0);
    km_window_group g[KM_MAX_WINDOW_GROUPS + 1] = {{0, 2}};
    for (uint32_t i = 0; i <= KM_MAX_WINDOW_GROUPS; i++)
        g[i] = (km_window_group){i, 2};
    cr_assert_eq(km_index_set_worker_windows(NULL, 0, g, 1), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_set_worker_windows(index, 0, NULL, 1), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_set_worker_windows(index, WORKERS, g, 1), KM_ERR_WORKER_RANGE);
    cr_assert_eq(km_index_set_worker_windows(index, 0, g, KM_MAX_WINDOW_GROUPS + 1),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(km_index_last_error(index), "at most"));
    g[1].blocks = 0;
    cr_assert_eq(km_index_set_worker_windows(index, 0, g, 2), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(km_index_last_error(index), "needs 0 blocks"));
    /* None of them took: the worker still scores by its plain prefix. */
    uint64_t chain = km_hash_chain_root(7);
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, &chain, 1), KM_OK);
    km_request q = {&chain, 1};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner_depth, 1);
    km_match_results_free(&res);
    km_index_destroy(index);
}
