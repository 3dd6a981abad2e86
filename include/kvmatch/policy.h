/* SPDX-License-Identifier: Apache-2.0 */
/* Decision policies: given the scored candidates of one request (each worker's matched prefix,
 * split by storage tier, and the load this kvmatch instance sees on it), pick the worker.
 *
 * Pure functions: no handle, no allocation, no I/O, no clock. Everything a decision depends on is
 * in its arguments, and the only mutable input is the caller's km_policy_state (round-robin cursor
 * and a seeded random source), so a decision can be replayed exactly from a record.
 *
 * Every decision keeps two workers apart (the best match may belong to another replica): the
 * OWNER of the prediction (the candidate with the deepest match) and the CHOSEN worker. They
 * differ whenever load outweighs the match, and a record must show both.
 *
 * Policies (km_policy_kind). Those named for a peer reproduce its rule, from the source named, on
 * the candidates kvmatch scores (its exact per-worker match instead of the peer's own index):
 *   kv           NVIDIA Dynamo's KV router, current form (lib/kv-router, DefaultWorkerSelector):
 *                prefill cost after a tier-weighted overlap credit, scaled, plus decode blocks;
 *                argmin or softmax sampling.
 *   cache_aware  vllm-router's cache_aware decision with its CLI defaults, on block overlap
 *                (depth / n_blocks) instead of matched characters / input characters.
 *   prefix       deepest match, ties to lower load; nothing matched -> least load.
 *   least_load   fewest in-flight requests.
 *   round_robin  a cursor over the candidate list, blind to load and cache.
 *   llmd         llm-d's precise prefix-cache routing as its shipped configuration weighs it
 *                (llm-d-inference-scheduler deploy/config/epp-precise-prefix-cache-config.yaml):
 *                precise-prefix-cache-scorer 2, kv-cache-utilization-scorer 1, queue-scorer 1,
 *                max-score picker. Differs: its KV utilization and waiting queue are the engine's
 *                metrics; here they are the candidates' (allocated blocks over the engine
 *                model's capacity, requests before their first token), which the service raises
 *                to the engine's scraped values when fresh; its picker breaks ties at random,
 *                here by least load.
 *   preble       Preble's E2 scheduling (ICLR'25; WukLab/preble, global_scheduler_with_time.py):
 *                exploit the workers holding the deepest match when its cached part outweighs
 *                the rest, else explore all; either way the lowest load cost (as in that code,
 *                which sets the request's own recomputation cost to 0, without the paper's
 *                prefill term of the request). Differs: Preble sums load over a 3-minute window
 *                of its own assignments and may add an eviction cost; here the load is the
 *                worker's current active work, timed by the engine model, and eviction is not
 *                costed; no post-assignment rebalancing.
 *   ttft         kvmatch's own: the lowest predicted time to first token (the engine model over
 *                the exact per-tier match, extended by the blocks prefills queued there will
 *                store, and the worker's queued prefill, decodes and KV), plus the prefill work a
 *                choice adds over the best-cached worker times the requests waiting where it adds
 *                it; a worker loaded past a bound is passed over while the request's prefix is
 *                hot there, so a hot prefix is copied rather than queued behind (or, where the
 *                caller can warm a worker up, the request stays with the holder and the copy is
 *                made by a prefill of the prefix alone, which no user waits for); workers within
 *                ttft.spread_ms of the lowest take arrivals in turn.
 * The exact rule of each is documented at km_policy_decide.
 *
 * Thread-safety: every function is reentrant. A km_policy_state is not: the caller serialises the
 * decisions that share one state (one state per pool, used by the scheduler thread). */
#ifndef KVMATCH_POLICY_H
#define KVMATCH_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/engine_model.h"
#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "No owner": no candidate holds even the request's first block. */
#define KM_POLICY_NO_OWNER UINT32_MAX
#define KM_POLICY_NO_WARM_UP UINT32_MAX

#define KM_POLICY_KIND_LIST(X)                                                                     \
    X(KM_POLICY_KV, "kv")                                                                          \
    X(KM_POLICY_CACHE_AWARE, "cache_aware")                                                        \
    X(KM_POLICY_PREFIX, "prefix")                                                                  \
    X(KM_POLICY_LEAST_LOAD, "least_load")                                                          \
    X(KM_POLICY_ROUND_ROBIN, "round_robin")                                                        \
    X(KM_POLICY_LLMD, "llmd")                                                                      \
    X(KM_POLICY_PREBLE, "preble")                                                                  \
    X(KM_POLICY_TTFT, "ttft")

typedef enum km_policy_kind {
#define KM_POLICY_KIND_ENUM(value, name) value,
    KM_POLICY_KIND_LIST(KM_POLICY_KIND_ENUM)
#undef KM_POLICY_KIND_ENUM
    KM_POLICY_KIND_COUNT
} km_policy_kind;

/* Why the chosen candidate was chosen; recorded with the decision:
 *   min_cost         kv, temperature 0: lowest cost (after tie breaks)
 *   sampled          kv, temperature > 0: drawn from the softmax
 *   cache_hit        cache_aware: match ratio above cache_threshold -> owner
 *   imbalance        cache_aware: load imbalanced -> least in-flight
 *   below_threshold  cache_aware: match ratio <= cache_threshold -> least in-flight
 *   deepest_match    prefix: the owner
 *   no_match         prefix: nobody holds block 0 -> least load
 *   least_load       least_load
 *   round_robin      round_robin
 *   max_score        llmd: the highest weighted score
 *   exploit          preble: the cached part outweighs the rest -> the lowest load cost of
 *                    the workers holding the deepest match
 *   explore          preble: otherwise -> the lowest load cost of all (the queued prefill and
 *                    the running decodes' remaining output; not the request's own prefill)
 *   min_ttft         ttft: the lowest predicted time to first token
 *   spread           ttft: not the lowest, but within spread_ms of it and the oldest last
 *                    arrival of those
 *   warm_up          ttft: not a user request's decision but the warm-up another decision asked
 *                    for (km_policy_decision.warm_up): the caller records it with this reason */
#define KM_POLICY_REASON_LIST(X)                                                                   \
    X(KM_POLICY_REASON_MIN_COST, "min_cost")                                                       \
    X(KM_POLICY_REASON_SAMPLED, "sampled")                                                         \
    X(KM_POLICY_REASON_CACHE_HIT, "cache_hit")                                                     \
    X(KM_POLICY_REASON_IMBALANCE, "imbalance")                                                     \
    X(KM_POLICY_REASON_BELOW_THRESHOLD, "below_threshold")                                         \
    X(KM_POLICY_REASON_DEEPEST_MATCH, "deepest_match")                                             \
    X(KM_POLICY_REASON_NO_MATCH, "no_match")                                                       \
    X(KM_POLICY_REASON_LEAST_LOAD, "least_load")                                                   \
    X(KM_POLICY_REASON_ROUND_ROBIN, "round_robin")                                                 \
    X(KM_POLICY_REASON_MAX_SCORE, "max_score")                                                     \
    X(KM_POLICY_REASON_EXPLOIT, "exploit")                                                         \
    X(KM_POLICY_REASON_EXPLORE, "explore")                                                         \
    X(KM_POLICY_REASON_MIN_TTFT, "min_ttft")                                                       \
    X(KM_POLICY_REASON_SPREAD, "spread")                                                           \
    X(KM_POLICY_REASON_WARM_UP, "warm_up")

typedef enum km_policy_reason {
#define KM_POLICY_REASON_ENUM(value, name) value,
    KM_POLICY_REASON_LIST(KM_POLICY_REASON_ENUM)
#undef KM_POLICY_REASON_ENUM
    KM_POLICY_REASON_COUNT
} km_policy_reason;

/* The largest value of each kv parameter (scale, tier weights, temperature): far past any tuning,
 * and small enough that every kv cost stays finite (a cost counts at most about 2^64 tokens). */
#define KM_POLICY_KV_PARAM_MAX 1e6

/* The largest value of each llmd scorer weight: far past any tuning, and small enough that every
 * llmd score (each scorer is in [0, 1]) stays finite. */
#define KM_POLICY_LLMD_WEIGHT_MAX 1e6

/* Policy parameters. km_policy_config_init sets the peers' defaults; fields of the policies a pool
 * does not use are ignored (but still validated, so a config file with a bad value fails early). */
typedef struct km_policy_config {
    km_policy_kind kind; /* default KM_POLICY_TTFT (docs/BENCHMARKS.md, "Routing") */
    struct {
        /* Multiplies the uncovered prefill blocks (Dynamo's prefill_load_scale, formerly
         * overlap_score_weight); 0 .. KM_POLICY_KV_PARAM_MAX; default 1.0. 0 = decode load
         * only. */
        double prefill_load_scale;
        /* Overlap credit per matched block by its best tier (Dynamo: device 1.0, host 0.75,
         * disk 0.25); 0 .. KM_POLICY_KV_PARAM_MAX. */
        double device_weight, host_weight, disk_weight;
        /* 0 = deterministic argmin; > 0 = softmax sampling (Dynamo's router_temperature);
         * 0 .. KM_POLICY_KV_PARAM_MAX; default 0. */
        double temperature;
    } kv;
    struct {
        /* Owner chosen when depth / n_blocks > cache_threshold; in [0, 1]; default 0.3. */
        double cache_threshold;
        /* Imbalanced when max - min in-flight > balance_abs_threshold (default 64) and
         * max > min * balance_rel_threshold (finite, >= 0; default 1.5). */
        uint32_t balance_abs_threshold;
        double balance_rel_threshold;
    } cache_aware;
    struct {
        /* Weights of llm-d's three scorers (0 .. KM_POLICY_LLMD_WEIGHT_MAX, not all 0): precise
         * prefix cache, queue, KV-cache utilization; defaults those llm-d's precise-prefix
         * configuration ships (km_policy_config_init). */
        double prefix_weight, queue_weight, kv_usage_weight;
        /* Prefix credit of a block held in host memory (llm-d's CPU tier weight; device is 1,
         * disk is weighted like host); in [0, 1]. */
        double host_tier_weight;
    } llmd;
    struct {
        /* Exploit when cached tokens > exploit_ratio x the tokens left to prefill (Preble's E2
         * rule is 1); finite, >= 0. */
        double exploit_ratio;
    } preble;
    struct {
        /* Bounded load (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam,
         * SODA'18): a worker whose in-flight requests would pass ceil(load_bound x (the
         * candidates' in-flight + 1) / n) is not weighed while the request's prefix is hot there
         * (prefix_sharers >= hot_prefix_sharers), its queued hit there is deeper than on every
         * worker within the bound (passing it over copies the prefix; a hit some worker within
         * the bound matches is weighed as usual), and some worker is within the bound. 0 = off,
         * else finite and >= 1; default 1.25. */
        double load_bound;
        /* Requests in flight on a worker sharing the request's prefix that make it hot there;
         * default 1 (any concurrent sharer). 0 bounds every worker whatever it holds, once
         * hot_prefix_share is 0 too (a holder without sharers never passes that limit). */
        uint32_t hot_prefix_sharers;
        /* No holder is passed over while the prefix's requests in flight on its holders (the
         * workers with the deepest queued hit), per holder, are fewer than hot_prefix_share x
         * the candidates' mean in flight (this request included): the holders' load is then
         * other prefixes' work, which copying this prefix would not take away. Finite, >= 0;
         * 0 = no such limit; default 0.25. */
        double hot_prefix_share;
        /* Workers whose cost is within spread_ms of the lowest count as equal, and of those the
         * one whose last arrival is the oldest (km_policy_candidate.last_arrival) is chosen:
         * near-equal workers take arrivals in turn and their prefills land in different steps,
         * rather than the load order sending a burst to one of them. Finite, >= 0, in ms;
         * 0 = off (the lowest cost wins); default 1. */
        double spread_ms;
    } ttft;
    /* The engines of the pool (ttft and preble estimate times with it; llmd divides KV usage by
     * its capacity_blocks). Default: km_engine_model_init. */
    km_engine_model engine;
} km_policy_config;

/* One candidate worker of one request. Scoring fills the match fields (km_index_match_batch: depth
 * and its tier split), the service's active-work tracker the load fields. */
typedef struct km_policy_candidate {
    uint32_t worker; /* worker id; ids must be distinct within one call (the last tie break) */
    /* Leading blocks of the request this worker holds, any tier; <= the request's n_blocks. */
    uint32_t depth;
    /* depth split by each block's best tier; device + host + disk must equal depth. */
    uint32_t device_blocks, host_blocks, disk_blocks;
    uint32_t in_flight;              /* requests routed to it and not finished, as this instance saw */
    uint32_t prefilling;             /* of those, requests whose first token is not seen yet */
    uint64_t pending_prefill_tokens; /* prompt tokens routed to it whose first token is not seen
                                      * yet, less what its events report computed
                                      * (km_active_blocks_stored) */
    uint64_t pending_prefill_pairs;  /* their attention pairs (km_active_load); only ttft reads it */
    uint64_t active_decode_blocks;   /* KV blocks of its running requests (prompt + output so far) */
    uint64_t allocated_blocks;       /* of those, the blocks they allocate: each one's less its
                                      * cached prefix (km_active_load.allocated_blocks) */
    /* Blocks the index says it holds in total (km_worker_stats.blocks; Dynamo's "tree size");
     * 0 = unknown. Only the kv policy's tie break reads it. */
    uint64_t indexed_blocks;
    /* Leading blocks of the request it will hold once the prefills already routed to it have run:
     * depth extended by the blocks those requests promised (km_active_queued_depth); 0 or below
     * depth = depth. <= n_blocks. Only the ttft policy reads it. */
    uint32_t queued_depth;
    /* Requests in flight on it that use the same cached prefix as this request (the prefix of its
     * hit there; km_active_prefix_sharers): how hot that prefix is on it. Only ttft reads it. */
    uint32_t prefix_sharers;
    /* When it last received a request, as a number that grows with every arrival in the pool
     * (km_active_last_arrival); 0 = none seen. Only ttft reads it (ttft.spread_ms). */
    uint64_t last_arrival;
} km_policy_candidate;

/* The request being placed. */
typedef struct km_policy_request {
    uint32_t n_blocks;   /* full blocks scored (the length of its chain-hash list) */
    /* Tokens per block, >= 1: the unit of every block count of the request and its candidates
     * (the engine model's capacity is converted from its own block size, engine_model.h). */
    uint32_t block_size;
    /* Prompt length in tokens, 0 = unknown (then n_blocks * block_size is assumed); when known it
     * must be >= n_blocks * block_size (a partial last block is not scored but must be prefilled). */
    uint64_t prompt_tokens;
    uint64_t expected_output_tokens; /* 0 = unknown */
    /* The caller can carry out a warm-up (km_policy_decision.warm_up): send a prefill of the
     * request's leading blocks alone to another worker, which nobody waits for. false: no
     * decision asks for one. */
    bool warm_ups;
} km_policy_request;

/* Mutable per-pool state: the round-robin cursor and a splitmix64 random source for softmax
 * sampling. Plain data: copy it to fork a replay, compare it to check determinism. */
typedef struct km_policy_state {
    uint64_t round_robin_cursor; /* the next round_robin decision picks cursor % n */
    uint64_t rng_state;
    /* Detail of the last failed km_policy_decide on this state ("" after a success); starts with
     * the error's enum name, e.g. "KM_ERR_INVALID_ARGUMENT: candidate 3 (worker 7): ...". */
    char last_error[192];
} km_policy_state;

typedef struct km_policy_decision {
    uint32_t chosen;        /* index into the candidate array */
    uint32_t owner;         /* index of the deepest match (ties: see km_policy_decide), or
                             * KM_POLICY_NO_OWNER when no candidate has depth >= 1 */
    uint32_t chosen_depth;  /* candidates[chosen].depth */
    uint32_t owner_depth;   /* candidates[owner].depth, 0 without an owner */
    /* owner_depth / n_blocks (0 when n_blocks is 0): cache_aware's "matched / input" ratio, on
     * blocks; filled by every policy so a record can show how good the best match was. */
    double match_ratio;
    double chosen_cost;     /* costs_out[chosen] (see km_policy_decide for its unit) */
    /* The engine model's (cfg->engine) predicted time to first token of the request on the
     * chosen candidate, from the decision, in ms: ttft's cost there without the work the choice
     * adds over the best-cached candidate. Every policy fills it, so that records can hold each
     * prediction against the time the router saw (kvmatch analyze, "TTFT prediction"). */
    double chosen_predicted_ttft_ms;
    km_policy_reason reason;
    /* Index of the candidate to warm up, or KM_POLICY_NO_WARM_UP: the caller sends it a prefill
     * of the request's first warm_up_blocks blocks (one output token, no user waiting), so that
     * the request's prefix is cached there too. Only ttft with req->warm_ups asks (rule at
     * km_policy_decide). */
    uint32_t warm_up;
    uint32_t warm_up_blocks; /* 0 without a warm-up */
} km_policy_decision;

/* ---- configuration ----------------------------------------------------------------------- */

/* Defaults: kind ttft; kv: prefill_load_scale 1, weights 1 / 0.75 / 0.25, temperature 0;
 * cache_aware: 0.3, 64, 1.5 (vllm-router's CLI defaults). */
void km_policy_config_init(km_policy_config *cfg);

/* KM_OK, or KM_ERR_NULL_POINTER (cfg NULL) / KM_ERR_INVALID_ARGUMENT (unknown kind; a NaN,
 * infinite or negative weight, scale, temperature or rel threshold; a kv parameter over
 * KM_POLICY_KV_PARAM_MAX; an llmd weight over KM_POLICY_LLMD_WEIGHT_MAX; cache_threshold outside
 * [0, 1]) with a sentence naming the field and
 * value in why (why may be NULL; truncated to why_size). */
int km_policy_config_validate(const km_policy_config *cfg, char *why, size_t why_size);

/* "kv", "cache_aware", "prefix", "least_load", "round_robin", "llmd", "preble", "ttft";
 * "unknown" for other values. */
const char *km_policy_kind_name(km_policy_kind kind);
/* Inverse of km_policy_kind_name (exact, case-sensitive). KM_ERR_NULL_POINTER, or
 * KM_ERR_INVALID_ARGUMENT for any other string; *out untouched on error. */
int km_policy_kind_parse(const char *name, km_policy_kind *out);
/* "min_cost", "sampled", "cache_hit", "imbalance", "below_threshold", "deepest_match",
 * "no_match", "least_load", "round_robin", "max_score", "exploit", "explore", "min_ttft", "spread";
 * "unknown" for other values. */
const char *km_policy_reason_name(km_policy_reason reason);

/* The load signal a policy weighs, for the decision record's "load kind":
 *   kv -> "active_decode_blocks" (plus pending prefill, inside the cost),
 *   cache_aware, prefix, least_load -> "in_flight_requests", llmd -> "queued_requests",
 *   preble, ttft -> "pending_prefill_tokens", round_robin -> "none".
 * Its scope is whatever load the candidates carry (the service states it). */
const char *km_policy_load_kind(km_policy_kind kind);
/* The value of that signal for one candidate: NAN for round_robin, which weighs none (a record
 * writes it as null, a DECISION reply as nil); 0 when cand is NULL. */
double km_policy_load_value(km_policy_kind kind, const km_policy_candidate *cand);
/* The owner km_policy_decide reports for cands[0..n) (the rule is under "deciding" below), for a
 * caller that weighs only some candidates and looks for the owner among the others too.
 * KM_POLICY_NO_OWNER when every depth is 0 or n is 0. */
uint32_t km_policy_owner(const km_policy_candidate *cands, uint32_t n);

/* ---- state ------------------------------------------------------------------------------- */

/* Cursor 0, random source seeded with seed (equal seeds give equal decision sequences), no error.
 * NULL is a no-op. */
void km_policy_state_init(km_policy_state *state, uint64_t seed);
/* Detail of the last failed km_policy_decide on this state; "" when none or state is NULL. */
const char *km_policy_last_error(const km_policy_state *state);

/* ---- deciding ---------------------------------------------------------------------------- */

/* Pick one of cands[0..n) for req under cfg. On KM_OK *out is filled and, when costs_out is not
 * NULL, costs_out[i] holds the number the policy compared for cands[i] (unit below).
 *
 * Owner (every policy): the candidate with the largest depth >= 1; ties -> lower load (fewer
 * in_flight, then fewer pending_prefill_tokens, then fewer active_decode_blocks), then the lower
 * worker id. KM_POLICY_NO_OWNER when every depth is 0.
 *
 * "Least load" below is the same order: in_flight, pending_prefill_tokens, active_decode_blocks,
 * worker id, each ascending.
 *
 * kv (Dynamo, current form). With B = block_size,
 *     request_tokens  = max(prompt_tokens, n_blocks * B)                 (Dynamo's isl)
 *     raw_prefill     = (request_tokens + pending_prefill_tokens) / B     (real, not rounded)
 *     overlap_credit  = device_blocks * device_weight + host_blocks * host_weight
 *                       + disk_blocks * disk_weight
 *     request_blocks  = max(n_blocks, ceil(prompt_tokens / B))
 *     decode_blocks   = active_decode_blocks + request_blocks + ceil(expected_output_tokens / B)
 *     cost            = prefill_load_scale * max(raw_prefill - overlap_credit, 0) + decode_blocks
 *   in blocks (costs_out). raw_prefill is Dynamo's raw_prefill_blocks, one division in floating
 *   point: a worker's pending prefill is not rounded up to whole blocks, so 1 queued token costs
 *   less than 16. The implementation sums in tokens and divides by B once, so with weights and a
 *   scale that are multiples of a power of two (every default) equal costs are equal doubles and
 *   fall to the tie breaks below. decode_blocks is the worker's KV footprint once it takes the
 *   request (Dynamo adds the request's blocks to each worker's active blocks); the request's own
 *   part is the same for every candidate, so it moves no choice, it only makes the cost read as
 *   a footprint. temperature 0: the minimum cost; exact ties -> fewer active_decode_blocks, then
 *   fewer in_flight, then fewer indexed_blocks (Dynamo's "smallest tree"), then the lower worker
 *   id (Dynamo draws at random among equal trees; a fixed order keeps decisions replayable).
 *   reason min_cost. temperature T > 0: Dynamo's softmax over normalised costs,
 *     p_i = exp(-x_i / T) / sum_j exp(-x_j / T),  x_i = (cost_i - min) / (max - min),
 *   uniform when all costs are equal; one draw u in [0, 1) from the state's random source picks
 *   the first i whose cumulative probability exceeds u. reason sampled. (A valid config keeps
 *   every cost finite; were one infinite, it would get probability 0, min and max coming from
 *   the finite ones, and with none finite the choice would be temperature 0's.)
 *
 * cache_aware (vllm-router cache_aware, its decision order). min, max = the smallest and largest
 *   in_flight among the candidates.
 *   1. Imbalanced when max - min > balance_abs_threshold AND max > min * balance_rel_threshold
 *      (both strict) -> the least in_flight (ties: lower worker id); reason imbalance.
 *   2. Else, when match_ratio = owner depth / n_blocks > cache_threshold (strict) -> the owner;
 *      reason cache_hit.
 *   3. Else the least in_flight (ties: lower worker id); reason below_threshold.
 *   Load is in_flight only, as in vllm-router (its tie goes to the first listed worker; here to
 *   the lower id). costs_out: in_flight, in requests.
 *
 * prefix: the owner; reason deepest_match. Without an owner, the least load; reason no_match.
 *   costs_out: n_blocks - depth (blocks left to prefill).
 *
 * least_load: the least load; reason least_load. costs_out: in_flight (the first key; the rest of
 *   the order breaks ties).
 *
 * round_robin: index state->round_robin_cursor % n, then the cursor advances by one; load and
 *   match are ignored; reason round_robin. costs_out: NAN for every candidate (it compares
 *   nothing), and chosen_cost NAN.
 *
 * Below, hit = min(depth, (T - 1) / B) blocks with T = max(prompt_tokens, n_blocks * B): what an
 * engine would count as cached (vLLM recomputes the prompt's last token). The engine model is
 * cfg->engine; a candidate's load in its terms: prefill_tokens = pending_prefill_tokens,
 * decode_requests = in_flight - prefilling, decode context = active_decode_blocks * B scaled by
 * the decodes' share of in_flight, used blocks = allocated_blocks.
 *
 * llmd: score = prefix_weight * P + queue_weight * Q + kv_usage_weight * (1 - U), the highest
 *   wins (ties: the load order); reason max_score; costs_out: the scores. P: the prefix credit
 *   (device blocks + host_tier_weight * (host + disk blocks)) min-max normalised over the
 *   candidates with depth >= 1 (1 when they are all equal or alone), 0 without a match. Q:
 *   (max - prefilling) / (max - min) over all candidates, 1 when all are equal. U: allocated_blocks
 *   / engine.capacity_blocks, at most 1.
 *
 * preble: exploit when owner's hit * B > exploit_ratio * (T - owner's hit * B): the candidates are
 *   those with depth == owner depth; else explore: all. The lowest load cost wins (ties: the load
 *   order); reasons exploit / explore; costs_out: every candidate's load cost in ms, L = the
 *   predicted time to prefill its queued tokens (km_engine_model_predict_ttft_us with no request
 *   of its own) + decode_requests * expected_output_tokens (1 when unknown) * its decode step.
 *
 * ttft: workers the bound leaves out (cfg->ttft: in_flight + 1 > the bound, prefix_sharers >=
 *   hot_prefix_sharers and a queued hit deeper than every within-bound worker's, while some worker
 *   has in_flight + 1 within it and the prefix_sharers of the deepest queued hit's holders sum to
 *   at least hot_prefix_share x holders x (sum of in_flight + 1) / n) are not weighed (cost NAN).
 *   With queued hit = min(max(depth, queued_depth), (T - 1) / B) (the blocks beyond depth
 *   are on the device): cost = km_engine_model_step_in_progress_us (the rest of the step it is
 *   running) + km_engine_model_predict_ttft_us (the worker's queue as its
 *   pending_prefill_tokens and pending_prefill_pairs; cached = queued hit * B with the hit's host
 *   and disk blocks, uncached = T - cached, the request's blocks ceil((T +
 *   expected_output_tokens) / B) less those in-flight work there holds already: the queued hit
 *   beyond depth, and while prefix_sharers > 0 the hit up to depth) + max(1, prefilling) * the
 *   prefill work of (T - cached) tokens
 *   beyond the best-cached candidate's (token_us per token plus the attention pairs), in ms; the
 *   lowest wins (ties: the deeper queued hit, then the load order). With spread_ms > 0, of the
 *   weighed candidates whose cost is at most the lowest + spread_ms, the smallest last_arrival
 *   wins instead (ties: the order above). Reason min_ttft, or spread when that is not the
 *   lowest-cost candidate; costs_out: the costs.
 *   Warm-ups (req->warm_ups): when the bound left out the candidate whose cost without the bound
 *   is the lowest (ties as above, no spread: the holder of the hot prefix), and it holds a deeper
 *   queued hit than the candidate chosen within the bound, the request goes to that holder
 *   instead (reason min_ttft, its cost in costs_out), and the decision asks for the within-bound
 *   choice to be warmed up with the holder's queued hit (warm_up, warm_up_blocks): the copy the
 *   bound wants is made, but no user request waits for its cold prefill. Once the warm-up is
 *   routed (queued there), the warmed worker's queued hit matches the holder's and the bound
 *   passes over nobody for it.
 *
 * Only round_robin (cursor) and kv with temperature > 0 (one random draw) change *state; a failed
 * call changes nothing but state->last_error.
 *
 * Errors (state->last_error says which argument and why; *out, costs_out untouched):
 *   KM_ERR_NULL_POINTER      cfg, state, req, cands or out NULL
 *   KM_ERR_INVALID_ARGUMENT  n == 0; an invalid cfg (km_policy_config_validate); a candidate whose
 *                            tier split does not add up to its depth, or whose depth or queued
 *                            depth exceeds n_blocks; prompt_tokens > 0 but < n_blocks * block_size
 *   KM_ERR_BLOCK_SIZE        block_size 0
 * Cost: O(n) (two more passes of exp() for sampling). */
int km_policy_decide(const km_policy_config *cfg, km_policy_state *state,
                     const km_policy_request *req, const km_policy_candidate *cands, uint32_t n,
                     km_policy_decision *out, double *costs_out);

/* The sampling distribution kv uses at temperature > 0 (formula above) for costs[0..n), into
 * probs[0..n) (sums to 1). For records and tests. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_INVALID_ARGUMENT (n == 0, temperature not finite or <= 0, a cost NaN or infinite). */
int km_policy_softmax_probabilities(const double *costs, uint32_t n, double temperature,
                                    double *probs);

#ifdef __cplusplus
}
#endif
#endif
