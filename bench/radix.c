/* SPDX-License-Identifier: Apache-2.0 */
/* Baseline "radix": NVIDIA Dynamo's RadixTree (lib/kv-router, ../shared/reference/peers.md).
 *
 * Reproduces: one node per block; a node's children are keyed by the child block's *local* hash
 * (LocalBlockHash, the per-block content hash), so a node is named by its path of local hashes;
 * every node holds the set of workers that have the block; a per-worker map engine hash -> node
 * (the chain hash plays the engine's ExternalSequenceBlockHash) finds a Stored event's parent and a
 * Removed event's node; a store whose parent the worker does not hold is refused (Dynamo's
 * "parent block not found" error, counted). find_matches walks from the root, one dependent pointer
 * chase per block, intersecting the active worker set with each node's set and recording each
 * worker's depth when it drops out, except where the node holds as many workers as are still
 * active (Dynamo's O(1) length check: the sets are then the same); cost O(depth) plus O(active
 * workers) at each node where some drop out. The length check is exact only while every worker's
 * blocks are prefix-closed; once a remove leaves a hole this tree intersects at every node
 * (Dynamo keeps the check and undercounts).
 *
 * Deliberate differences, both for exactness against km_index: Dynamo clears a node's children when
 * its last worker leaves ("true for all children" under leaf-first eviction); here a node goes only
 * when it has neither workers nor children, so a worker holding a block after a hole keeps it.
 * Scores only, no frequencies / tree sizes.
 *
 * Optimised as a C implementation of that design would be: nodes in one array addressed by u32
 * (no per-node allocation, 56 bytes each), the only child stored inline in its parent (a chain
 * costs no table), small open-addressing children tables beyond that, 16-byte worker sets
 * (6 ids inline, a bitmap beyond), per-worker lookups in open-addressing maps. */
#include <stdlib.h>
#include <string.h>

#include "baseline_impl.h"

#define ROOT 0u

typedef struct radix_node {
    uint64_t local;            /* key of this node in its parent's children */
    km_bl_set workers;
    km_bl_children children;
    uint32_t parent;           /* node index; next free node while on the free list */
    uint32_t reserved;
} radix_node;

typedef struct radix_tree {
    uint32_t max_workers, words;
    km_bl_memory memory;
    radix_node *nodes;
    uint32_t nodes_high, nodes_capacity, free_head;
    uint64_t live_nodes;
    km_bl_map *lookup; /* per worker: chain hash -> node index */
    km_baseline_stats stats;
    bool holes; /* a remove left some worker holding a block without its parent (sticky) */
} radix_tree;

static int node_new(radix_tree *t, uint64_t local, uint32_t parent, uint32_t *out)
{
    uint32_t idx;
    if (t->free_head != KM_BL_NO_NODE) {
        idx = t->free_head;
        t->free_head = t->nodes[idx].parent;
    } else {
        if (t->nodes_high == t->nodes_capacity) {
            if (t->nodes_capacity >= UINT32_MAX / 2)
                return KM_ERR_OUT_OF_MEMORY;
            uint32_t cap = t->nodes_capacity ? t->nodes_capacity * 2 : 1024;
            radix_node *n = km_bl_realloc(&t->memory, t->nodes,
                                          (size_t)t->nodes_capacity * sizeof(radix_node),
                                          (size_t)cap * sizeof(radix_node));
            if (!n)
                return KM_ERR_OUT_OF_MEMORY;
            t->nodes = n;
            t->nodes_capacity = cap;
        }
        idx = t->nodes_high++;
    }
    radix_node *n = &t->nodes[idx];
    memset(n, 0, sizeof(*n));
    n->local = local;
    n->parent = parent;
    t->live_nodes++;
    *out = idx;
    return KM_OK;
}

/* Drop nodes that hold nothing and lead nowhere, from idx up towards the root. */
static void prune(radix_tree *t, uint32_t idx)
{
    while (idx != ROOT) {
        radix_node *n = &t->nodes[idx];
        if (km_bl_set_count(&n->workers) != 0 || n->children.count != 0)
            return;
        uint32_t parent = n->parent;
        km_bl_children_del(&t->nodes[parent].children, n->local, &t->memory);
        km_bl_set_release(&n->workers, t->words, &t->memory);
        km_bl_children_release(&n->children, &t->memory);
        n->parent = t->free_head;
        t->free_head = idx;
        t->live_nodes--;
        idx = parent;
    }
}

static int radix_create(uint32_t max_workers, void **state)
{
    radix_tree *t = calloc(1, sizeof(*t));
    if (!t)
        return KM_ERR_OUT_OF_MEMORY;
    t->max_workers = max_workers;
    t->words = km_bl_words(max_workers);
    t->free_head = KM_BL_NO_NODE;
    t->lookup = km_bl_calloc(&t->memory, max_workers, sizeof(km_bl_map));
    uint32_t root;
    if (!t->lookup || node_new(t, 0, KM_BL_NO_NODE, &root) != KM_OK) {
        free(t->lookup);
        free(t->nodes);
        free(t);
        return KM_ERR_OUT_OF_MEMORY;
    }
    t->live_nodes = 0; /* the root is not a block */
    *state = t;
    return KM_OK;
}

static void radix_destroy(void *state)
{
    radix_tree *t = state;
    if (!t)
        return;
    for (uint32_t i = 0; i < t->nodes_high; i++) {
        /* Free-listed nodes were released already and zeroed apart from `parent`. */
        km_bl_set_release(&t->nodes[i].workers, t->words, &t->memory);
        km_bl_children_release(&t->nodes[i].children, &t->memory);
    }
    for (uint32_t w = 0; w < t->max_workers; w++)
        km_bl_map_release(&t->lookup[w], &t->memory);
    free(t->lookup);
    free(t->nodes);
    free(t);
}

static int radix_store(void *state, uint32_t worker, uint64_t parent, const uint64_t *chain,
                       const uint64_t *local, size_t n)
{
    radix_tree *t = state;
    uint32_t cur = ROOT;
    if (parent != KM_NO_PARENT) {
        const km_bl_map_entry *e = km_bl_map_find(&t->lookup[worker], parent);
        if (!e) {
            t->stats.rejected_stores++;
            return KM_ERR_INVALID_ARGUMENT;
        }
        cur = (uint32_t)e->value;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t child = km_bl_children_find(&t->nodes[cur].children, local[i]);
        if (child == KM_BL_NO_NODE) {
            int rc = node_new(t, local[i], cur, &child);
            if (rc == KM_OK)
                rc = km_bl_children_add(&t->nodes[cur].children, local[i], child, &t->memory);
            if (rc != KM_OK)
                return rc;
        }
        int added = km_bl_set_add(&t->nodes[child].workers, worker, t->words, &t->memory);
        if (added < 0)
            return added;
        if (added) {
            int rc = km_bl_map_put(&t->lookup[worker], chain[i], child, &t->memory);
            if (rc != KM_OK) {
                km_bl_set_remove(&t->nodes[child].workers, worker, t->words, &t->memory);
                prune(t, child);
                return rc;
            }
            t->stats.stored++;
            t->stats.pairs++;
        } else {
            t->stats.duplicate_stores++;
        }
        cur = child;
    }
    return KM_OK;
}

static const km_bl_set *workers_of(const void *tree, uint32_t node)
{
    return &((const radix_tree *)tree)->nodes[node].workers;
}

/* Whether worker holds a child of node (a remove of node from it then leaves a hole). */
static bool holds_a_child(const radix_tree *t, uint32_t node, uint32_t worker)
{
    return km_bl_children_held_by(&t->nodes[node].children, workers_of, t, worker);
}

static int radix_remove(void *state, uint32_t worker, const uint64_t *chain, size_t n)
{
    radix_tree *t = state;
    for (size_t i = 0; i < n; i++) {
        uint64_t node;
        if (!km_bl_map_take(&t->lookup[worker], chain[i], &node)) {
            t->stats.absent_removes++;
            continue;
        }
        km_bl_set_remove(&t->nodes[node].workers, worker, t->words, &t->memory);
        t->holes = t->holes || holds_a_child(t, (uint32_t)node, worker);
        t->stats.removed++;
        t->stats.pairs--;
        prune(t, (uint32_t)node);
    }
    return KM_OK;
}

static void radix_match(const void *state, const uint64_t *chain, const uint64_t *local, uint32_t n,
                        km_baseline_result *r)
{
    (void)chain;
    const radix_tree *t = state;
    const radix_node *nodes = t->nodes;
    uint32_t *open = r->scratch;
    uint32_t cur = km_bl_children_find(&nodes[ROOT].children, local[0]);
    r->visits = 1;
    if (cur == KM_BL_NO_NODE)
        return;
    uint32_t m = km_bl_walk_start(&nodes[cur].workers, t->words, r, open);
    uint32_t n_open = m;
    uint32_t i = 1;
    for (; i < n && n_open > 0; i++) {
        uint32_t next = km_bl_children_find(&nodes[cur].children, local[i]);
        r->visits++;
        if (next == KM_BL_NO_NODE)
            break;
        km_bl_walk_filter(&nodes[next].workers, i, r, open, &n_open, !t->holes);
        cur = next;
    }
    km_bl_walk_finish(r, m, open, n_open, i);
}

static void radix_stats(const void *state, km_baseline_stats *out)
{
    const radix_tree *t = state;
    *out = t->stats;
    out->nodes = t->live_nodes;
    /* The nodes array grows by doubling; count the entries in use, as a per-object allocator
     * would hold, not the slack. */
    out->memory_bytes = t->memory.bytes -
                        (uint64_t)(t->nodes_capacity - t->nodes_high) * sizeof(radix_node);
}

const km_baseline_ops km_baseline_radix_ops = {
    .name = "radix",
    .create = radix_create,
    .destroy = radix_destroy,
    .store = radix_store,
    .remove = radix_remove,
    .match = radix_match,
    .stats = radix_stats,
    .needs_local = 1,
    .needs_chain_for_match = 0,
};
