/* SPDX-License-Identifier: Apache-2.0 */
/* The benchmark's baseline indexes (bench/baselines.h) against a brute-force model on fresh random
 * streams: blocks of a random tree of sequences stored (with their parents) and removed (holes
 * included) by a handful of workers, and every answer of every baseline compared with the model's:
 * for each worker holding block 0 of a request, the count of leading blocks it holds. A first
 * phase only stores (every worker's blocks prefix-closed, where the trees skip the intersection of
 * a node whose holders are as many as the workers still open); the second removes blocks anywhere,
 * so a worker may hold a block without its parent and the trees must intersect again. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "../bench/baselines.h"
#include "test_util.h"

#define NODES 400u
#define MAX_DEPTH 24u
#define MAX_WORKERS 9u /* more than a worker set's inline ids: sets take their bitmap form too */

/* The universe: a tree of blocks. Node 0 is a virtual root (no block). */
typedef struct universe {
    uint32_t parent[NODES];
    uint32_t depth[NODES]; /* blocks from the root: a child of the root has depth 1 */
    uint64_t local[NODES];
    uint64_t chain[NODES];
    bool held[MAX_WORKERS][NODES];
    uint32_t n;
} universe;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= UINT64_C(0x7fb5d329728ea185);
    x ^= x >> 27;
    x *= UINT64_C(0x81dadef4bc2dd44d);
    return x ^ (x >> 33);
}

static void universe_make(universe *u, km_rng *rng)
{
    memset(u, 0, sizeof *u);
    u->n = NODES;
    for (uint32_t v = 1; v < NODES; v++) {
        uint32_t p;
        do /* a shallow random parent: long shared prefixes, some branching */
            p = km_rng_percent(rng, 70) && v > 1 ? v - 1 : km_rng_below(rng, v);
        while (u->depth[p] >= MAX_DEPTH);
        u->parent[v] = p;
        u->depth[v] = u->depth[p] + 1;
        /* a small space of local hashes, so blocks under different parents share some; siblings
         * differ (a tree names a child by its local hash) */
        bool taken;
        do {
            u->local[v] = 1000 + km_rng_below(rng, 40);
            taken = false;
            for (uint32_t s = 1; s < v && !taken; s++)
                taken = u->parent[s] == p && u->local[s] == u->local[v];
        } while (taken);
        u->chain[v] = mix((p ? u->chain[p] : UINT64_C(0x5eed)) ^ mix(u->local[v]));
    }
}

/* The path root -> v as block indexes, into out (depth of v entries). */
static uint32_t path_to(const universe *u, uint32_t v, uint32_t *out)
{
    uint32_t d = u->depth[v];
    for (uint32_t i = d; i > 0; i--, v = u->parent[v])
        out[i - 1] = v;
    return d;
}

static void check_answers(km_baseline *const *bl, km_baseline_result *res, const universe *u,
                          uint32_t workers, km_rng *rng, const char *phase)
{
    for (int q = 0; q < 60; q++) {
        uint32_t path[MAX_DEPTH + 1];
        uint32_t n = path_to(u, 1 + km_rng_below(rng, NODES - 1), path);
        uint64_t chain[MAX_DEPTH + 1], local[MAX_DEPTH + 1];
        for (uint32_t i = 0; i < n; i++) {
            chain[i] = u->chain[path[i]];
            local[i] = u->local[path[i]];
        }
        uint32_t real = n;
        if (km_rng_percent(rng, 20)) { /* a block nobody holds at the end */
            local[n] = 999;
            chain[n] = mix(chain[n - 1] ^ 999);
            n++;
        }
        /* the model: leading blocks held, for each worker holding block 0 */
        uint32_t depth[MAX_WORKERS], holders = 0, owner = KM_NO_WORKER, owner_depth = 0;
        for (uint32_t w = 0; w < workers; w++) {
            uint32_t d = 0;
            while (d < real && u->held[w][path[d]])
                d++;
            depth[w] = d;
            holders += d > 0;
            if (d > owner_depth) {
                owner_depth = d;
                owner = w;
            }
        }
        for (int k = 0; k < KM_BASELINE_KIND_COUNT; k++) {
            cr_assert_eq(km_baseline_match(bl[k], chain, local, n, &res[k]), KM_OK);
            const km_baseline_result *r = &res[k];
            const char *name = km_baseline_name((km_baseline_kind)k);
            cr_assert_eq(r->count, holders, "%s, %s, query %d: %u holders, model %u", phase, name, q,
                         r->count, holders);
            uint32_t j = 0;
            for (uint32_t w = 0; w < workers; w++) {
                if (!depth[w])
                    continue;
                cr_assert(r->matches[j].worker == w && r->matches[j].depth == depth[w],
                          "%s, %s, query %d: entry %u is worker %u at %u, model worker %u at %u",
                          phase, name, q, j, r->matches[j].worker, r->matches[j].depth, w,
                          depth[w]);
                j++;
            }
            cr_assert(r->owner == owner && r->owner_depth == owner_depth,
                      "%s, %s, query %d: owner %u at %u, model %u at %u", phase, name, q, r->owner,
                      r->owner_depth, owner, owner_depth);
        }
    }
}

Test(baselines, every_answer_matches_a_brute_force_model_with_and_without_holes, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    for (int round = 0; round < 6; round++) {
        universe *u = malloc(sizeof *u);
        cr_assert(u);
        universe_make(u, &rng);
        uint32_t workers = round % 2 ? MAX_WORKERS : 3;
        km_baseline *bl[KM_BASELINE_KIND_COUNT];
        km_baseline_result res[KM_BASELINE_KIND_COUNT];
        for (int k = 0; k < KM_BASELINE_KIND_COUNT; k++) {
            cr_assert_eq(km_baseline_create((km_baseline_kind)k, MAX_WORKERS, &bl[k]), KM_OK);
            memset(&res[k], 0, sizeof res[k]);
            cr_assert_eq(km_baseline_result_init(bl[k], &res[k]), KM_OK);
        }
        for (int phase = 0; phase < 2; phase++) {
            for (int op = 0; op < 3000; op++) {
                uint32_t w = km_rng_below(&rng, workers);
                uint32_t v = 1 + km_rng_below(&rng, NODES - 1);
                uint32_t p = u->parent[v];
                if (phase == 1 && km_rng_percent(&rng, 40)) {
                    /* remove any block it holds: its children may stay, a hole */
                    if (!u->held[w][v])
                        continue;
                    for (int k = 0; k < KM_BASELINE_KIND_COUNT; k++)
                        cr_assert_eq(km_baseline_remove(bl[k], w, &u->chain[v], 1), KM_OK);
                    u->held[w][v] = false;
                    continue;
                }
                /* store a block whose parent the worker holds (the trees refuse others) */
                if (u->held[w][v] || (p && !u->held[w][p]))
                    continue;
                uint64_t parent = p ? u->chain[p] : KM_NO_PARENT;
                for (int k = 0; k < KM_BASELINE_KIND_COUNT; k++)
                    cr_assert_eq(km_baseline_store(bl[k], w, parent, &u->chain[v], &u->local[v], 1),
                                 KM_OK, "%s: store", km_baseline_name((km_baseline_kind)k));
                u->held[w][v] = true;
                if (op % 500 == 499)
                    check_answers(bl, res, u, workers, &rng, phase ? "with holes" : "stores only");
            }
            check_answers(bl, res, u, workers, &rng, phase ? "with holes" : "stores only");
        }
        for (int k = 0; k < KM_BASELINE_KIND_COUNT; k++) {
            km_baseline_result_free(&res[k]);
            km_baseline_destroy(bl[k]);
        }
        free(u);
    }
}
