/* Window rules: a hybrid model's sliding-window KV-cache groups bound a worker's matched depth as
 * vLLM's HybridKVCacheCoordinator bounds its hit (kvmatch/index.h, km_index_set_worker_windows).
 * A host step after the backend's walk, reading the host tables, so both backends give the same
 * results; the plain prefix walk is untouched and the step is skipped while no worker has a rule. */
#include <stdlib.h>

#include "kvmatch/hash.h"
#include "index/index_internal.h"

struct km_window_rule {
    uint32_t n_groups;
    km_window_group groups[KM_MAX_WINDOW_GROUPS];
};

int km_index_set_worker_windows(km_index *index, uint32_t worker, const km_window_group *groups,
                                uint32_t n_groups)
{
    if (!index)
        return KM_ERR_NULL_POINTER;
    index->last_error[0] = '\0';
    if (n_groups && !groups)
        return km_index_fail(index, KM_ERR_NULL_POINTER, "window groups is NULL");
    if (worker >= index->config.max_workers)
        return km_index_fail(index, KM_ERR_WORKER_RANGE, "worker %u; max_workers is %u", worker,
                             index->config.max_workers);
    if (n_groups > KM_MAX_WINDOW_GROUPS)
        return km_index_fail(index, KM_ERR_INVALID_ARGUMENT, "%u window groups; at most %u",
                             n_groups, KM_MAX_WINDOW_GROUPS);
    for (uint32_t g = 0; g < n_groups; g++)
        if (groups[g].blocks == 0)
            return km_index_fail(index, KM_ERR_INVALID_ARGUMENT,
                                 "window group %u (tag %u) needs 0 blocks; at least 1", g,
                                 groups[g].group);
    if (!index->window_rules) {
        if (!n_groups)
            return KM_OK;
        index->window_rules = calloc(index->config.max_workers, sizeof *index->window_rules);
        if (!index->window_rules)
            return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "window rules of %u workers",
                                 index->config.max_workers);
    }
    struct km_window_rule *rule = &index->window_rules[worker];
    index->window_rule_workers += (n_groups != 0) - (rule->n_groups != 0);
    rule->n_groups = n_groups;
    for (uint32_t g = 0; g < n_groups; g++)
        rule->groups[g] = groups[g];
    return KM_OK;
}

static bool holds(const km_index *index, uint64_t key, uint32_t worker)
{
    uint64_t slot = km_table_find(&index->blocks, key);
    return slot != KM_SLOT_NONE && km_table_set_contains(&index->blocks, slot, worker);
}

/* vLLM's SlidingWindowManager.find_longest_cache_hit over blocks [0, limit): from the right, the
 * first run of `blocks` held blocks ends the hit; without one, the held run from block 0 does. */
static uint32_t window_end(const km_index *index, const uint64_t *hashes, uint32_t worker,
                           uint32_t limit, km_window_group g, uint32_t *probes)
{
    uint32_t run = 0;
    for (uint32_t i = limit; i-- > 0;) {
        (*probes)++;
        if (!holds(index, km_hash_window_key(hashes[i], g.group), worker)) {
            run = 0;
        } else if (++run >= g.blocks) {
            return i + run;
        }
    }
    return run;
}

/* The coordinator's fixed point: each group lowers the candidate or accepts it, until every group
 * accepts the same candidate. A group accepts the depth it just gave (its scan from there ends
 * there), so the scan stops once the groups after it all accept. */
static uint32_t window_depth(const km_index *index, const uint64_t *hashes, uint32_t worker,
                             uint32_t depth, const struct km_window_rule *rule, uint32_t *probes)
{
    for (uint32_t g = 0, accepted = 0; accepted < rule->n_groups && depth;
         g = (g + 1) % rule->n_groups) {
        uint32_t end = window_end(index, hashes, worker, depth, rule->groups[g], probes);
        accepted = end < depth ? 1 : accepted + 1;
        depth = end;
    }
    return depth;
}

void km_window_rules_apply(const km_index *index, const km_request *requests, size_t n,
                           km_match_results *results)
{
    /* Entries only shrink, and in order, so they are compacted in place. */
    uint64_t out = 0;
    for (size_t q = 0; q < n; q++) {
        km_request_result *rr = &results->requests[q];
        uint64_t first = rr->first;
        uint32_t count = rr->count, probes = 0;
        rr->first = out;
        rr->count = 0;
        rr->owner = KM_NO_WORKER;
        rr->owner_depth = 0;
        for (uint32_t j = 0; j < count; j++) {
            km_worker_match m = results->matches[first + j];
            const struct km_window_rule *rule = &index->window_rules[m.worker];
            if (rule->n_groups)
                m.depth = window_depth(index, requests[q].hashes, m.worker, m.depth, rule, &probes);
            if (!m.depth)
                continue;
            results->matches[out++] = m;
            rr->count++;
            if (m.depth > rr->owner_depth) { /* entries ascend by worker: ties keep the lowest */
                rr->owner = m.worker;
                rr->owner_depth = m.depth;
            }
        }
        rr->probes += probes;
        results->probes += probes;
    }
    results->n_matches = out;
}
