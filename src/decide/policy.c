/* SPDX-License-Identifier: Apache-2.0 */
/* Decision policies (include/kvmatch/policy.h): pure functions from one request's scored candidates
 * to a chosen worker, plus the owner of the deepest match kept apart from it. No allocation: every
 * pass recomputes what it needs from the candidates, which is cheaper than scratch memory at the
 * sizes a pool has (up to a few thousand workers), and keeps the functions reentrant. */
#include "kvmatch/policy.h"
#include "base/error_detail.h"

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* ---- names -------------------------------------------------------------------------------- */

static const char *const kind_names[KM_POLICY_KIND_COUNT] = {
#define KM_POLICY_KIND_NAME(value, name) [value] = name,
    KM_POLICY_KIND_LIST(KM_POLICY_KIND_NAME)
#undef KM_POLICY_KIND_NAME
};

static const char *const reason_names[KM_POLICY_REASON_COUNT] = {
#define KM_POLICY_REASON_NAME(value, name) [value] = name,
    KM_POLICY_REASON_LIST(KM_POLICY_REASON_NAME)
#undef KM_POLICY_REASON_NAME
};

const char *km_policy_kind_name(km_policy_kind kind)
{
    if ((unsigned)kind < KM_POLICY_KIND_COUNT)
        return kind_names[kind];
    return "unknown";
}

int km_policy_kind_parse(const char *name, km_policy_kind *out)
{
    if (!name || !out)
        return KM_ERR_NULL_POINTER;
    for (unsigned k = 0; k < KM_POLICY_KIND_COUNT; k++) {
        if (strcmp(name, kind_names[k]) == 0) {
            *out = (km_policy_kind)k;
            return KM_OK;
        }
    }
    return KM_ERR_INVALID_ARGUMENT;
}

const char *km_policy_reason_name(km_policy_reason reason)
{
    if ((unsigned)reason < KM_POLICY_REASON_COUNT)
        return reason_names[reason];
    return "unknown";
}

const char *km_policy_load_kind(km_policy_kind kind)
{
    switch (kind) {
    case KM_POLICY_KV:
        return "active_decode_blocks";
    case KM_POLICY_CACHE_AWARE:
    case KM_POLICY_PREFIX:
    case KM_POLICY_LEAST_LOAD:
        return "in_flight_requests";
    case KM_POLICY_ROUND_ROBIN:
        return "none";
    case KM_POLICY_LLMD:
        return "queued_requests";
    case KM_POLICY_PREBLE:
    case KM_POLICY_TTFT:
        return "pending_prefill_tokens";
    case KM_POLICY_KIND_COUNT:
        break;
    }
    return "unknown";
}

double km_policy_load_value(km_policy_kind kind, const km_policy_candidate *cand)
{
    if (!cand)
        return 0.0;
    switch (kind) {
    case KM_POLICY_KV:
        return (double)cand->active_decode_blocks;
    case KM_POLICY_CACHE_AWARE:
    case KM_POLICY_PREFIX:
    case KM_POLICY_LEAST_LOAD:
        return (double)cand->in_flight;
    case KM_POLICY_ROUND_ROBIN:
        return NAN; /* weighs no load: records write null, replies nil, never a measured 0 */
    case KM_POLICY_LLMD:
        return (double)cand->prefilling;
    case KM_POLICY_PREBLE:
    case KM_POLICY_TTFT:
        return (double)cand->pending_prefill_tokens;
    case KM_POLICY_KIND_COUNT:
        break;
    }
    return 0.0;
}

/* ---- configuration ------------------------------------------------------------------------ */

void km_policy_config_init(km_policy_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->kind = KM_POLICY_TTFT;
    cfg->kv.prefill_load_scale = 1.0;
    cfg->kv.device_weight = 1.0;
    cfg->kv.host_weight = 0.75;
    cfg->kv.disk_weight = 0.25;
    cfg->kv.temperature = 0.0;
    cfg->cache_aware.cache_threshold = 0.3;
    cfg->cache_aware.balance_abs_threshold = 64;
    cfg->cache_aware.balance_rel_threshold = 1.5;
    cfg->llmd.prefix_weight = 2.0;
    cfg->llmd.queue_weight = 1.0;
    cfg->llmd.kv_usage_weight = 1.0;
    cfg->llmd.host_tier_weight = 0.8;
    cfg->preble.exploit_ratio = 1.0;
    cfg->ttft.load_bound = 1.25;
    cfg->ttft.hot_prefix_sharers = 1;
    cfg->ttft.hot_prefix_share = 0.25;
    cfg->ttft.spread_ms = 1.0;
    km_engine_model_init(&cfg->engine);
}

static int fail(char *why, size_t why_size, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(why, why_size, status, fmt, ap);
    va_end(ap);
    return status;
}

/* A finite value >= 0, or a sentence naming the field. */
static int check_non_negative(const char *field, double value, char *why, size_t why_size)
{
    if (isnan(value) || isinf(value) || value < 0.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config %s is %g; it must be a finite number >= 0", field, value);
    return KM_OK;
}

/* A value in [0, max], or a sentence naming the field. */
static int check_at_most(const char *field, double value, double max, char *why, size_t why_size)
{
    if (isnan(value) || value < 0.0 || value > max)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config %s is %g; it must lie in [0, %g]", field, value, max);
    return KM_OK;
}

/* A kv parameter: 0 .. KM_POLICY_KV_PARAM_MAX, or a sentence naming the field. */
static int check_kv_param(const char *field, double value, char *why, size_t why_size)
{
    return check_at_most(field, value, KM_POLICY_KV_PARAM_MAX, why, why_size);
}

/* An llmd weight: 0 .. KM_POLICY_LLMD_WEIGHT_MAX, or a sentence naming the field. */
static int check_llmd_weight(const char *field, double value, char *why, size_t why_size)
{
    return check_at_most(field, value, KM_POLICY_LLMD_WEIGHT_MAX, why, why_size);
}

int km_policy_config_validate(const km_policy_config *cfg, char *why, size_t why_size)
{
    if (why && why_size)
        why[0] = '\0';
    if (!cfg)
        return fail(why, why_size, KM_ERR_NULL_POINTER, "policy config is NULL");
    if ((unsigned)cfg->kind >= KM_POLICY_KIND_COUNT)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy kind %d is unknown (kv, cache_aware, prefix, least_load, round_robin, "
                    "llmd, preble, ttft)",
                    (int)cfg->kind);
    int rc;
    if ((rc = check_kv_param("kv.prefill_load_scale", cfg->kv.prefill_load_scale, why,
                             why_size)) ||
        (rc = check_kv_param("kv.device_weight", cfg->kv.device_weight, why, why_size)) ||
        (rc = check_kv_param("kv.host_weight", cfg->kv.host_weight, why, why_size)) ||
        (rc = check_kv_param("kv.disk_weight", cfg->kv.disk_weight, why, why_size)) ||
        (rc = check_kv_param("kv.temperature", cfg->kv.temperature, why, why_size)) ||
        (rc = check_non_negative("cache_aware.balance_rel_threshold",
                                 cfg->cache_aware.balance_rel_threshold, why, why_size)) ||
        (rc = check_llmd_weight("llmd.prefix_weight", cfg->llmd.prefix_weight, why, why_size)) ||
        (rc = check_llmd_weight("llmd.queue_weight", cfg->llmd.queue_weight, why, why_size)) ||
        (rc = check_llmd_weight("llmd.kv_usage_weight", cfg->llmd.kv_usage_weight, why,
                                why_size)) ||
        (rc = check_non_negative("preble.exploit_ratio", cfg->preble.exploit_ratio, why,
                                 why_size)))
        return rc;
    if (cfg->llmd.prefix_weight + cfg->llmd.queue_weight + cfg->llmd.kv_usage_weight <= 0.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config llmd weights are all 0; at least one must be positive");
    double bound = cfg->ttft.load_bound;
    if (isnan(bound) || isinf(bound) || (bound != 0.0 && bound < 1.0))
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config ttft.load_bound is %g; it must be 0 (off) or a finite value "
                    ">= 1",
                    bound);
    double share = cfg->ttft.hot_prefix_share;
    if (isnan(share) || isinf(share) || share < 0.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config ttft.hot_prefix_share is %g; it must be a finite value >= 0",
                    share);
    double spread = cfg->ttft.spread_ms;
    if (isnan(spread) || isinf(spread) || spread < 0.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config ttft.spread_ms is %g; it must be a finite value >= 0", spread);
    double h = cfg->llmd.host_tier_weight;
    if (isnan(h) || h < 0.0 || h > 1.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config llmd.host_tier_weight is %g; it must lie in [0, 1]", h);
    char model_why[160];
    if ((rc = km_engine_model_validate(&cfg->engine, model_why, sizeof model_why)))
        return fail(why, why_size, rc, "policy config engine: %s", model_why);
    double t = cfg->cache_aware.cache_threshold;
    if (isnan(t) || t < 0.0 || t > 1.0)
        return fail(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "policy config cache_aware.cache_threshold is %g; it must lie in [0, 1]", t);
    return KM_OK;
}

/* ---- state -------------------------------------------------------------------------------- */

void km_policy_state_init(km_policy_state *state, uint64_t seed)
{
    if (!state)
        return;
    memset(state, 0, sizeof *state);
    state->rng_state = seed;
}

const char *km_policy_last_error(const km_policy_state *state)
{
    return state ? state->last_error : "";
}

/* splitmix64 (Steele, Lea, Flood 2014): one 64-bit state word, full period, good enough for
 * choosing among workers, and trivially replayable from a recorded state. */
static uint64_t rng_next(km_policy_state *state)
{
    uint64_t z = (state->rng_state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(km_policy_state *state)
{
    return (double)(rng_next(state) >> 11) * 0x1.0p-53;
}

/* ---- orders and costs --------------------------------------------------------------------- */

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

/* Three-way compare of two unsigned values: -1, 0, 1. */
#define CMP3(a, b) (((a) > (b)) - ((a) < (b)))

/* "Least load" order: in_flight, pending_prefill_tokens, active_decode_blocks, worker id. */
static int compare_load(const km_policy_candidate *a, const km_policy_candidate *b)
{
    int c;
    if ((c = CMP3(a->in_flight, b->in_flight)))
        return c;
    if ((c = CMP3(a->pending_prefill_tokens, b->pending_prefill_tokens)))
        return c;
    if ((c = CMP3(a->active_decode_blocks, b->active_decode_blocks)))
        return c;
    return CMP3(a->worker, b->worker);
}

/* The index of the least-loaded candidate. */
static uint32_t least_loaded(const km_policy_candidate *cands, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (compare_load(&cands[i], &cands[best]) < 0)
            best = i;
    return best;
}

/* The index of the fewest in_flight, ties to the lower worker id (cache_aware's load). */
static uint32_t least_in_flight(const km_policy_candidate *cands, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++) {
        const km_policy_candidate *a = &cands[i], *b = &cands[best];
        if (a->in_flight < b->in_flight || (a->in_flight == b->in_flight && a->worker < b->worker))
            best = i;
    }
    return best;
}

/* The deepest match (depth >= 1), ties by the load order; KM_POLICY_NO_OWNER when none. */
static uint32_t find_owner(const km_policy_candidate *cands, uint32_t n)
{
    uint32_t owner = KM_POLICY_NO_OWNER;
    for (uint32_t i = 0; i < n; i++) {
        if (cands[i].depth == 0)
            continue;
        if (owner == KM_POLICY_NO_OWNER || cands[i].depth > cands[owner].depth ||
            (cands[i].depth == cands[owner].depth && compare_load(&cands[i], &cands[owner]) < 0))
            owner = i;
    }
    return owner;
}

uint32_t km_policy_owner(const km_policy_candidate *cands, uint32_t n)
{
    return cands ? find_owner(cands, n) : KM_POLICY_NO_OWNER;
}

/* The parts of the kv cost that depend on the request only. */
typedef struct kv_request_terms {
    double request_tokens; /* max(prompt_tokens, n_blocks * B): Dynamo's isl */
    double request_blocks; /* max(n_blocks, ceil(prompt_tokens / B)) */
    double output_blocks;  /* ceil(expected_output_tokens / B) */
} kv_request_terms;

static kv_request_terms kv_terms(const km_policy_request *req)
{
    kv_request_terms t;
    uint64_t scored_tokens = (uint64_t)req->n_blocks * req->block_size;
    t.request_tokens =
        (double)(req->prompt_tokens > scored_tokens ? req->prompt_tokens : scored_tokens);
    uint64_t prompt_blocks = ceil_div(req->prompt_tokens, req->block_size);
    t.request_blocks = (double)(prompt_blocks > req->n_blocks ? prompt_blocks : req->n_blocks);
    t.output_blocks = (double)ceil_div(req->expected_output_tokens, req->block_size);
    return t;
}

/* Dynamo's raw prefill is (active_prefill_tokens + isl) / B, one division in floating point: a
 * worker with 1 queued token is cheaper than one with 16, which rounding each worker's pending
 * prefill up to whole blocks would tie (or, with prefill_load_scale != 1, invert). The sum stays
 * in tokens until one final division, so with dyadic weights and scale (every default) the
 * numerator is exact and equal costs are equal doubles: ties break by compare_kv's order, not by
 * the rounding of a different sequence of operations. */
static double kv_cost(const km_policy_config *cfg, const km_policy_request *req,
                      const kv_request_terms *t, const km_policy_candidate *c)
{
    double block_size = (double)req->block_size;
    double raw_prefill_tokens = t->request_tokens + (double)c->pending_prefill_tokens;
    double overlap_credit = (double)c->device_blocks * cfg->kv.device_weight +
                            (double)c->host_blocks * cfg->kv.host_weight +
                            (double)c->disk_blocks * cfg->kv.disk_weight;
    double uncovered_tokens = raw_prefill_tokens - overlap_credit * block_size;
    if (uncovered_tokens < 0.0)
        uncovered_tokens = 0.0;
    double decode_blocks = (double)c->active_decode_blocks + t->request_blocks + t->output_blocks;
    return (cfg->kv.prefill_load_scale * uncovered_tokens + decode_blocks * block_size) /
           block_size;
}

/* kv's order at temperature 0: cost, active_decode_blocks, in_flight, indexed_blocks, worker. */
static int compare_kv(double cost_a, const km_policy_candidate *a, double cost_b,
                      const km_policy_candidate *b)
{
    int c;
    if ((c = CMP3(cost_a, cost_b)))
        return c;
    if ((c = CMP3(a->active_decode_blocks, b->active_decode_blocks)))
        return c;
    if ((c = CMP3(a->in_flight, b->in_flight)))
        return c;
    if ((c = CMP3(a->indexed_blocks, b->indexed_blocks)))
        return c;
    return CMP3(a->worker, b->worker);
}

/* ---- softmax ------------------------------------------------------------------------------ */

/* Dynamo's weights: exp(-(cost - min) / ((max - min) * T)), all 1 when max == min, over finite
 * costs and a finite min and max; an infinite (or NaN) cost weighs 0, never drawn. The largest
 * weight is exactly 1 (at the minimum cost), so the sum is in [1, n] and never overflows. Finite
 * costs whose range passes the largest double are normalised at half their scale, so that no
 * weight is inf / inf. */
static double softmax_weight(double cost, double min, double max, double temperature)
{
    if (!isfinite(cost))
        return 0.0;
    if (max == min)
        return 1.0;
    if (isinf(max - min))
        return exp(-((cost * 0.5 - min * 0.5) / (max * 0.5 - min * 0.5)) / temperature);
    return exp(-((cost - min) / (max - min)) / temperature);
}

int km_policy_softmax_probabilities(const double *costs, uint32_t n, double temperature,
                                    double *probs)
{
    if (!costs || !probs)
        return KM_ERR_NULL_POINTER;
    if (n == 0 || isnan(temperature) || isinf(temperature) || temperature <= 0.0)
        return KM_ERR_INVALID_ARGUMENT;
    double min = costs[0], max = costs[0];
    for (uint32_t i = 0; i < n; i++) {
        if (isnan(costs[i]) || isinf(costs[i]))
            return KM_ERR_INVALID_ARGUMENT;
        if (costs[i] < min)
            min = costs[i];
        if (costs[i] > max)
            max = costs[i];
    }
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++)
        sum += softmax_weight(costs[i], min, max, temperature);
    for (uint32_t i = 0; i < n; i++)
        probs[i] = softmax_weight(costs[i], min, max, temperature) / sum;
    return KM_OK;
}

/* ---- the policies --------------------------------------------------------------------------- */

static void decide_kv(const km_policy_config *cfg, km_policy_state *state,
                      const km_policy_request *req, const km_policy_candidate *cands, uint32_t n,
                      km_policy_decision *out, double *costs_out)
{
    kv_request_terms t = kv_terms(req);
    double min = INFINITY, max = -INFINITY; /* over the finite costs (softmax_weight) */
    uint32_t best = 0;
    double best_cost = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        double cost = kv_cost(cfg, req, &t, &cands[i]);
        if (costs_out)
            costs_out[i] = cost;
        if (isfinite(cost) && cost < min)
            min = cost;
        if (isfinite(cost) && cost > max)
            max = cost;
        if (i == 0 || compare_kv(cost, &cands[i], best_cost, &cands[best]) < 0) {
            best = i;
            best_cost = cost;
        }
    }
    if (cfg->kv.temperature == 0.0 || !isfinite(min)) { /* temperature 0, or nothing to weigh */
        out->chosen = best;
        out->chosen_cost = best_cost;
        out->reason = KM_POLICY_REASON_MIN_COST;
        return;
    }
    double temperature = cfg->kv.temperature;
    double sum = 0.0;
    /* The passes below recompute each cost (the same expression, so the same double) unless the
     * caller gave costs_out, which already holds them. */
    for (uint32_t i = 0; i < n; i++) {
        double cost = costs_out ? costs_out[i] : kv_cost(cfg, req, &t, &cands[i]);
        sum += softmax_weight(cost, min, max, temperature);
    }
    double target = rng_uniform(state) * sum;
    double cumulative = 0.0;
    uint32_t chosen = UINT32_MAX, last_positive = 0;
    double chosen_cost = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        double cost = costs_out ? costs_out[i] : kv_cost(cfg, req, &t, &cands[i]);
        double w = softmax_weight(cost, min, max, temperature);
        if (w <= 0.0)
            continue; /* underflowed or infinite: probability 0, never drawn */
        last_positive = i;
        cumulative += w;
        if (target < cumulative) {
            chosen = i;
            chosen_cost = cost;
            break;
        }
    }
    if (chosen == UINT32_MAX) { /* rounding left target at or above the last cumulative sum */
        chosen = last_positive;
        chosen_cost = kv_cost(cfg, req, &t, &cands[chosen]);
    }
    out->chosen = chosen;
    out->chosen_cost = chosen_cost;
    out->reason = KM_POLICY_REASON_SAMPLED;
}

static void decide_cache_aware(const km_policy_config *cfg, const km_policy_candidate *cands,
                               uint32_t n, km_policy_decision *out, double *costs_out)
{
    uint32_t min = cands[0].in_flight, max = cands[0].in_flight;
    for (uint32_t i = 0; i < n; i++) {
        if (costs_out)
            costs_out[i] = (double)cands[i].in_flight;
        if (cands[i].in_flight < min)
            min = cands[i].in_flight;
        if (cands[i].in_flight > max)
            max = cands[i].in_flight;
    }
    bool imbalanced = (uint64_t)(max - min) > cfg->cache_aware.balance_abs_threshold &&
                      (double)max > (double)min * cfg->cache_aware.balance_rel_threshold;
    if (imbalanced) {
        out->chosen = least_in_flight(cands, n);
        out->reason = KM_POLICY_REASON_IMBALANCE;
    } else if (out->owner != KM_POLICY_NO_OWNER &&
               out->match_ratio > cfg->cache_aware.cache_threshold) {
        out->chosen = out->owner;
        out->reason = KM_POLICY_REASON_CACHE_HIT;
    } else {
        out->chosen = least_in_flight(cands, n);
        out->reason = KM_POLICY_REASON_BELOW_THRESHOLD;
    }
    out->chosen_cost = (double)cands[out->chosen].in_flight;
}

/* ---- engine-model helpers (ttft, preble) --------------------------------------------------- */

/* Tokens of the request: max(prompt_tokens, n_blocks * B). */
static uint64_t request_tokens(const km_policy_request *req)
{
    uint64_t scored = (uint64_t)req->n_blocks * req->block_size;
    return req->prompt_tokens > scored ? req->prompt_tokens : scored;
}

/* Blocks of the candidate's match an engine would count as a hit: vLLM recomputes the prompt's
 * last token, so a hit never covers it (min(depth, (prompt - 1) / B)). */
static uint32_t hit_of_depth(const km_policy_request *req, uint32_t depth)
{
    uint64_t tokens = request_tokens(req);
    if (tokens == 0)
        return 0;
    uint64_t cap = (tokens - 1) / req->block_size;
    return depth < cap ? depth : (uint32_t)cap;
}

static uint32_t hit_blocks(const km_policy_request *req, const km_policy_candidate *c)
{
    return hit_of_depth(req, c->depth);
}

/* c's depth once the prefills queued on it have run: extended by their promised blocks. */
static uint32_t queued_depth_of(const km_policy_candidate *c)
{
    return c->queued_depth > c->depth ? c->queued_depth : c->depth;
}

static uint32_t queued_hit_blocks(const km_policy_request *req, const km_policy_candidate *c)
{
    return hit_of_depth(req, queued_depth_of(c));
}

/* A count of the request's blocks (block_size tokens each) in the engine model's blocks: the
 * engine's capacity and per-block load times are in blocks of its own block_size, which a pool
 * may not share. Rounded up; unchanged when the sizes agree. */
static uint64_t in_engine_blocks(const km_engine_model *m, uint64_t blocks, uint32_t block_size)
{
    if (block_size == m->block_size || blocks == 0)
        return blocks;
    double tokens = (double)blocks * (double)block_size;
    double converted = ceil(tokens / (double)m->block_size);
    return converted >= 1e18 ? UINT64_C(1000000000000000000) : (uint64_t)converted;
}

/* blocks * block_size tokens, UINT64_MAX when that does not fit in 64 bits. */
static uint64_t tokens_of_blocks(uint64_t blocks, uint32_t block_size)
{
    return blocks > UINT64_MAX / block_size ? UINT64_MAX : blocks * block_size;
}

/* floor(total * part / whole) for part <= whole, whole >= 1, without forming the product: it is
 * at most total, so it never wraps to a smaller value. */
static uint64_t share_of(uint64_t total, uint32_t part, uint32_t whole)
{
    return total / whole * part + total % whole * part / whole;
}

/* The candidate's load in the engine model's terms. Decode context is not tracked per request:
 * the decodes' share of the worker's KV footprint stands in for it. */
static km_engine_load engine_load_of(const km_engine_model *m, const km_policy_candidate *c,
                                     uint32_t block_size)
{
    km_engine_load load;
    uint32_t prefilling = c->prefilling < c->in_flight ? c->prefilling : c->in_flight;
    load.prefill_tokens = c->pending_prefill_tokens;
    load.prefill_requests = prefilling;
    load.decode_requests = c->in_flight - prefilling;
    load.decode_context_tokens =
        c->in_flight ? share_of(tokens_of_blocks(c->active_decode_blocks, block_size),
                                load.decode_requests, c->in_flight)
                     : 0;
    load.used_blocks = in_engine_blocks(m, c->allocated_blocks, block_size);
    load.prefill_pairs = c->pending_prefill_pairs;
    return load;
}

/* The predicted time to first token of req on c, in microseconds: the rest of the step c is
 * running, then its queue and the request's own prefill (engine_model.h). */
static double predicted_ttft_us(const km_policy_config *cfg, const km_policy_request *req,
                                const km_policy_candidate *c)
{
    uint32_t hit = queued_hit_blocks(req, c);
    /* The hit's lower-tier blocks are the last of its depth only when the split says so; the
     * split does not say where each tier lies, so every lower-tier block inside the hit counts.
     * Blocks beyond depth that queued prefills will store land on the device. */
    uint32_t lower = c->host_blocks + c->disk_blocks;
    uint32_t host = c->host_blocks, disk = c->disk_blocks;
    if (lower > hit) {
        uint32_t drop = lower - hit;
        uint32_t from_disk = drop < disk ? drop : disk;
        disk -= from_disk;
        host -= drop - from_disk;
    }
    uint64_t tokens = request_tokens(req);
    uint64_t cached = (uint64_t)hit * req->block_size;
    const km_engine_model *m = &cfg->engine;
    uint64_t footprint = tokens > UINT64_MAX - req->expected_output_tokens
                             ? UINT64_MAX
                             : tokens + req->expected_output_tokens;
    uint64_t request_blocks = ceil_div(footprint, m->block_size);
    /* What in-flight work there already holds is in its used blocks: the hit's blocks beyond
     * depth (queued prefills compute them) and, while it has sharers, the cached prefix they use
     * (km_active charges a shared prefix once per worker). The rest is new. */
    uint32_t cached_part = hit < c->depth ? hit : c->depth;
    uint64_t held = (uint64_t)(hit - cached_part) + (c->prefix_sharers ? cached_part : 0);
    uint64_t held_in_engine = held * req->block_size / m->block_size;
    request_blocks = request_blocks > held_in_engine ? request_blocks - held_in_engine : 0;
    km_engine_load load = engine_load_of(m, c, req->block_size);
    uint64_t host_blocks = in_engine_blocks(m, host, req->block_size);
    uint64_t disk_blocks = in_engine_blocks(m, disk, req->block_size);
    host = host_blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)host_blocks;
    disk = disk_blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)disk_blocks;
    return km_engine_model_step_in_progress_us(m, &load) +
           km_engine_model_predict_ttft_us(m, &load, cached, tokens - cached, host, disk,
                                           request_blocks, req->expected_output_tokens);
}

/* ---- llmd: llm-d's precise prefix-cache scorer with its load scorers ------------------------- */

static double llmd_prefix_credit(const km_policy_config *cfg, const km_policy_candidate *c)
{
    return (double)c->device_blocks + cfg->llmd.host_tier_weight * (double)(c->host_blocks + c->disk_blocks);
}

static double llmd_kv_usage(const km_policy_config *cfg, const km_policy_request *req,
                            const km_policy_candidate *c)
{
    uint64_t used = in_engine_blocks(&cfg->engine, c->allocated_blocks, req->block_size);
    double usage = (double)used / (double)cfg->engine.capacity_blocks;
    return usage < 1.0 ? usage : 1.0;
}

/* (value - min) / (max - min), and 1 when every candidate has the same value (llm-d's min-max
 * normalisation; flip = 1 scores the smallest value highest). */
static double min_max(double value, double min, double max, int flip)
{
    if (max == min)
        return 1.0;
    double x = (value - min) / (max - min);
    return flip ? 1.0 - x : x;
}

static void decide_llmd(const km_policy_config *cfg, const km_policy_request *req,
                        const km_policy_candidate *cands, uint32_t n, km_policy_decision *out,
                        double *costs_out)
{
    /* The prefix scorer normalises over the workers that hold the request's first block only
     * (min-max; 1 when they all match alike, a lone holder included); the others score 0. So of
     * two holders the shorter match scores 0, as a miss does: llm-d's rule, kept. */
    double pmin = 0, pmax = 0, qmin = 0, qmax = 0;
    bool any_holder = false;
    for (uint32_t i = 0; i < n; i++) {
        double q = (double)cands[i].prefilling;
        if (i == 0 || q < qmin)
            qmin = q;
        if (i == 0 || q > qmax)
            qmax = q;
        if (cands[i].depth == 0)
            continue;
        double p = llmd_prefix_credit(cfg, &cands[i]);
        if (!any_holder || p < pmin)
            pmin = p;
        if (!any_holder || p > pmax)
            pmax = p;
        any_holder = true;
    }
    uint32_t best = 0;
    double best_score = -1.0;
    for (uint32_t i = 0; i < n; i++) {
        const km_policy_candidate *c = &cands[i];
        double prefix = c->depth ? min_max(llmd_prefix_credit(cfg, c), pmin, pmax, 0) : 0.0;
        double score = cfg->llmd.prefix_weight * prefix +
                       cfg->llmd.queue_weight * min_max((double)c->prefilling, qmin, qmax, 1) +
                       cfg->llmd.kv_usage_weight * (1.0 - llmd_kv_usage(cfg, req, c));
        if (costs_out)
            costs_out[i] = score;
        if (i == 0 || score > best_score ||
            (score == best_score && compare_load(c, &cands[best]) < 0)) {
            best = i;
            best_score = score;
        }
    }
    out->chosen = best;
    out->chosen_cost = best_score;
    out->reason = KM_POLICY_REASON_MAX_SCORE;
}

/* ---- preble: Preble's E2 (exploit the cached prefix, else explore by load) ------------------- */

/* Preble's load cost L_i of c, in microseconds: the prefill time of the work queued there plus
 * its running decodes' remaining output at c's time per output token. Preble sums both over a
 * window of recent assignments and takes the median output length; here the worker's current
 * active work stands in for the window and the request's expected output (Preble's fallback,
 * max_new_tokens) for the median. */
static double preble_load_us(const km_policy_config *cfg, const km_policy_request *req,
                             const km_policy_candidate *c)
{
    const km_engine_model *m = &cfg->engine;
    km_engine_load load = engine_load_of(m, c, req->block_size);
    km_engine_load queue_only = load;
    queue_only.used_blocks = 0;
    queue_only.prefill_pairs = 0; /* the queue's prefill time from its token count, as before */
    double prefill = load.prefill_tokens
                         ? km_engine_model_predict_ttft_us(m, &queue_only, 0, 0, 0, 0, 0, 0)
                         : 0.0;
    km_engine_step decode = {0, 0, load.decode_requests, load.decode_context_tokens};
    double tpot = km_engine_model_step_us(m, &decode);
    double output = (double)(req->expected_output_tokens ? req->expected_output_tokens : 1);
    return prefill + (double)load.decode_requests * output * tpot;
}

static void decide_preble(const km_policy_config *cfg, const km_policy_request *req,
                          const km_policy_candidate *cands, uint32_t n, km_policy_decision *out,
                          double *costs_out)
{
    /* Exploit when the cached part (the deepest match anywhere) outweighs the rest: the candidates
     * are the workers holding that match; else explore over every worker. Either way the lowest
     * load cost wins (ties: the load order). */
    bool exploit = false;
    if (out->owner != KM_POLICY_NO_OWNER) {
        uint64_t tokens = request_tokens(req);
        uint64_t cached = (uint64_t)hit_blocks(req, &cands[out->owner]) * req->block_size;
        exploit = (double)cached > cfg->preble.exploit_ratio * (double)(tokens - cached);
    }
    uint32_t best = UINT32_MAX;
    double best_cost = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        double cost = preble_load_us(cfg, req, &cands[i]) / 1000.0;
        if (costs_out)
            costs_out[i] = cost;
        if (exploit && cands[i].depth != out->owner_depth)
            continue;
        if (best == UINT32_MAX || cost < best_cost ||
            (cost == best_cost && compare_load(&cands[i], &cands[best]) < 0)) {
            best = i;
            best_cost = cost;
        }
    }
    out->chosen = best;
    out->chosen_cost = best_cost;
    out->reason = exploit ? KM_POLICY_REASON_EXPLOIT : KM_POLICY_REASON_EXPLORE;
}

/* ---- ttft: the lowest predicted time to first token ----------------------------------------- */

/* The prefill time of `tokens` tokens after `before` cached ones on an idle engine, beyond its
 * step floor: the work a choice adds to the cluster. */
static double prefill_work_us(const km_engine_model *m, uint64_t before, uint64_t tokens)
{
    return m->token_us * (double)tokens +
           m->prefill_us_per_pair * (double)km_engine_model_chunk_pairs(before, tokens);
}

/* The most requests a worker may hold after this one while the request's prefix is hot there:
 * ceil(load_bound * (the candidates' in-flight requests + 1) / n) (consistent hashing with
 * bounded loads); infinite when load_bound is 0. */
static double ttft_load_bound(const km_policy_config *cfg, const km_policy_candidate *cands,
                              uint32_t n)
{
    if (cfg->ttft.load_bound <= 0.0)
        return INFINITY;
    double total = 0.0;
    for (uint32_t i = 0; i < n; i++)
        total += cands[i].in_flight;
    return ceil(cfg->ttft.load_bound * (total + 1.0) / n);
}

/* Whether the request's prefix is busy enough on its holders (the candidates with the deepest
 * queued hit, best_hit > 0) for a copy to relieve them: its requests in flight there, per holder,
 * are at least hot_prefix_share x the candidates' mean in flight (this request included). Below
 * it the holders' load is other prefixes' work, which a copy of this one would not take away. */
static bool ttft_prefix_hot_enough(const km_policy_config *cfg, const km_policy_request *req,
                                   const km_policy_candidate *cands, uint32_t n, uint32_t best_hit)
{
    double sharers = 0.0, holders = 0.0, total = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        total += cands[i].in_flight;
        if (queued_hit_blocks(req, &cands[i]) == best_hit) {
            sharers += cands[i].prefix_sharers;
            holders += 1.0;
        }
    }
    return sharers >= cfg->ttft.hot_prefix_share * holders * (total + 1.0) / n;
}

/* What decide_ttft weighs, once per request. */
typedef struct ttft_terms {
    uint64_t tokens;   /* request_tokens */
    double best_work;  /* prefill_work_us of the best-cached candidate's uncached part */
    double bound;      /* ttft_load_bound */
    bool any_within;   /* holders past the bound are passed over (some worker is within it and
                        * the prefix is hot enough on its holders) */
    uint32_t within_hit; /* the deepest queued hit among the workers within the bound */
} ttft_terms;

static ttft_terms ttft_terms_of(const km_policy_config *cfg, const km_policy_request *req,
                                const km_policy_candidate *cands, uint32_t n)
{
    ttft_terms t = {.tokens = request_tokens(req)};
    uint32_t best_hit = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t hit = queued_hit_blocks(req, &cands[i]);
        best_hit = hit > best_hit ? hit : best_hit;
    }
    uint64_t best_cached = (uint64_t)best_hit * req->block_size;
    t.best_work = prefill_work_us(&cfg->engine, best_cached, t.tokens - best_cached);
    /* Bounded load: a worker past the bound, where the request's prefix is hot and deeper than
     * on any worker within the bound, is not weighed while some worker is within it (the hot
     * prefix is copied to a less loaded worker rather than queued behind its holder's load). A
     * holder whose hit some worker within the bound matches is weighed as usual: passing it over
     * would copy nothing; nor is any holder passed over while the prefix's own requests are too
     * few of the holders' load for a copy to relieve them (ttft_prefix_hot_enough). */
    t.bound = ttft_load_bound(cfg, cands, n);
    for (uint32_t i = 0; i < n; i++)
        if ((double)cands[i].in_flight + 1.0 <= t.bound) {
            uint32_t hit = queued_hit_blocks(req, &cands[i]);
            t.within_hit = hit > t.within_hit ? hit : t.within_hit;
            t.any_within = true;
        }
    if (t.any_within && best_hit > t.within_hit &&
        !ttft_prefix_hot_enough(cfg, req, cands, n, best_hit))
        t.any_within = false;
    return t;
}

/* A candidate's cost in ms, NAN when the bound leaves it out. The time to first token predicted
 * there, plus the prefill work the choice adds over the best-cached candidate (the tokens that
 * one would not recompute) times the requests it will delay: those that arrive at that worker
 * while it is still busy, about as many as wait there now (at least one). */
static double ttft_cost_ms(const km_policy_config *cfg, const km_policy_request *req,
                           const ttft_terms *t, const km_policy_candidate *c)
{
    if (t->any_within && (double)c->in_flight + 1.0 > t->bound &&
        c->prefix_sharers >= cfg->ttft.hot_prefix_sharers &&
        queued_hit_blocks(req, c) > t->within_hit)
        return NAN;
    uint64_t cached = (uint64_t)queued_hit_blocks(req, c) * req->block_size;
    double extra = prefill_work_us(&cfg->engine, cached, t->tokens - cached) - t->best_work;
    double delayed = c->prefilling > 1 ? (double)c->prefilling : 1.0;
    return (predicted_ttft_us(cfg, req, c) + delayed * (extra > 0 ? extra : 0)) / 1000.0;
}

/* Whether candidate a (cost cost_a) goes before b (cost_b): the lower cost, then the deeper
 * queued hit (it leaves the others' caches for other prefixes), then the least load. */
static bool ttft_before(double cost_a, const km_policy_candidate *a, double cost_b,
                        const km_policy_candidate *b)
{
    if (cost_a != cost_b)
        return cost_a < cost_b;
    int by_depth = CMP3(queued_depth_of(b), queued_depth_of(a));
    return by_depth < 0 || (by_depth == 0 && compare_load(a, b) < 0);
}

/* The candidate of the lowest cost under terms t (ties: ttft_before), its cost in *cost_ms (NAN
 * when every candidate is left out); each cost into costs_out when it is not NULL. */
static uint32_t ttft_lowest(const km_policy_config *cfg, const km_policy_request *req,
                            const km_policy_candidate *cands, uint32_t n, const ttft_terms *t,
                            double *costs_out, double *cost_ms)
{
    uint32_t best = 0;
    double best_ms = NAN;
    for (uint32_t i = 0; i < n; i++) {
        double ms = ttft_cost_ms(cfg, req, t, &cands[i]);
        if (costs_out)
            costs_out[i] = ms;
        if (!isnan(ms) && (isnan(best_ms) || ttft_before(ms, &cands[i], best_ms, &cands[best]))) {
            best = i;
            best_ms = ms;
        }
    }
    *cost_ms = best_ms;
    return best;
}

/* The bound chose out->chosen within it. When the choice without the bound is a holder the bound
 * left out, with a deeper queued hit than out->chosen's, the request goes to that holder and
 * out->chosen is warmed up with the holder's queued hit instead: the same copy, made by a
 * prefill no user waits for. */
static void ttft_warm_up_instead(const km_policy_config *cfg, const km_policy_request *req,
                                 const km_policy_candidate *cands, uint32_t n,
                                 const ttft_terms *bounded, km_policy_decision *out,
                                 double *costs_out)
{
    ttft_terms unbounded = *bounded;
    unbounded.any_within = false;
    double holder_ms;
    uint32_t holder = ttft_lowest(cfg, req, cands, n, &unbounded, NULL, &holder_ms);
    uint32_t warmed = out->chosen;
    uint32_t hit = queued_hit_blocks(req, &cands[holder]);
    if (holder == warmed || !isnan(ttft_cost_ms(cfg, req, bounded, &cands[holder])) ||
        hit <= queued_hit_blocks(req, &cands[warmed]))
        return;
    out->chosen = holder;
    out->chosen_cost = holder_ms;
    out->reason = KM_POLICY_REASON_MIN_TTFT;
    out->warm_up = warmed;
    out->warm_up_blocks = hit;
    if (costs_out)
        costs_out[holder] = holder_ms;
}

static void decide_ttft(const km_policy_config *cfg, const km_policy_request *req,
                        const km_policy_candidate *cands, uint32_t n, km_policy_decision *out,
                        double *costs_out)
{
    ttft_terms t = ttft_terms_of(cfg, req, cands, n);
    double best_ms;
    uint32_t best = ttft_lowest(cfg, req, cands, n, &t, costs_out, &best_ms);
    /* Within spread_ms of the lowest cost, the oldest last arrival (then the order above). The
     * costs are read back from costs_out, or computed again without it. */
    double spread = cfg->ttft.spread_ms;
    uint32_t pick = best;
    double pick_ms = best_ms;
    for (uint32_t i = 0; spread > 0.0 && i < n; i++) {
        double ms = costs_out ? costs_out[i] : ttft_cost_ms(cfg, req, &t, &cands[i]);
        if (isnan(ms) || ms > best_ms + spread)
            continue;
        uint64_t at = cands[i].last_arrival, pick_at = cands[pick].last_arrival;
        if (at < pick_at || (at == pick_at && ttft_before(ms, &cands[i], pick_ms, &cands[pick]))) {
            pick = i;
            pick_ms = ms;
        }
    }
    out->chosen = pick;
    out->chosen_cost = pick_ms;
    out->reason = pick == best ? KM_POLICY_REASON_MIN_TTFT : KM_POLICY_REASON_SPREAD;
    if (req->warm_ups && t.any_within)
        ttft_warm_up_instead(cfg, req, cands, n, &t, out, costs_out);
}

/* ---- validation and dispatch -------------------------------------------------------------- */

static int state_fail(km_policy_state *state, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(state->last_error, sizeof state->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

static int validate_input(const km_policy_config *cfg, km_policy_state *state,
                          const km_policy_request *req, const km_policy_candidate *cands,
                          uint32_t n)
{
    int rc = km_policy_config_validate(cfg, state->last_error, sizeof state->last_error);
    if (rc != KM_OK)
        return rc;
    if (n == 0)
        return state_fail(state, KM_ERR_INVALID_ARGUMENT,
                          "no candidate workers: a decision needs at least one");
    if (req->block_size == 0)
        return state_fail(state, KM_ERR_BLOCK_SIZE, "request block_size is 0");
    uint64_t scored_tokens = (uint64_t)req->n_blocks * req->block_size;
    if (req->prompt_tokens != 0 && req->prompt_tokens < scored_tokens)
        return state_fail(state, KM_ERR_INVALID_ARGUMENT,
                          "request prompt_tokens %llu is fewer than its %u blocks of %u tokens",
                          (unsigned long long)req->prompt_tokens, req->n_blocks, req->block_size);
    for (uint32_t i = 0; i < n; i++) {
        const km_policy_candidate *c = &cands[i];
        if (c->depth > req->n_blocks)
            return state_fail(state, KM_ERR_INVALID_ARGUMENT,
                              "candidate %u (worker %u): depth %u exceeds the request's %u blocks",
                              i, c->worker, c->depth, req->n_blocks);
        if (c->queued_depth > req->n_blocks)
            return state_fail(state, KM_ERR_INVALID_ARGUMENT,
                              "candidate %u (worker %u): queued depth %u exceeds the request's %u "
                              "blocks",
                              i, c->worker, c->queued_depth, req->n_blocks);
        uint64_t split = (uint64_t)c->device_blocks + c->host_blocks + c->disk_blocks;
        if (split != c->depth)
            return state_fail(state, KM_ERR_INVALID_ARGUMENT,
                              "candidate %u (worker %u): tier split %u device + %u host + %u disk "
                              "does not add up to depth %u",
                              i, c->worker, c->device_blocks, c->host_blocks, c->disk_blocks,
                              c->depth);
    }
    return KM_OK;
}

int km_policy_decide(const km_policy_config *cfg, km_policy_state *state,
                     const km_policy_request *req, const km_policy_candidate *cands, uint32_t n,
                     km_policy_decision *out, double *costs_out)
{
    if (!state)
        return KM_ERR_NULL_POINTER;
    if (!cfg || !req || !cands || !out)
        return state_fail(state, KM_ERR_NULL_POINTER, "km_policy_decide: %s is NULL",
                          !cfg ? "cfg" : !req ? "req" : !cands ? "cands" : "out");
    int rc = validate_input(cfg, state, req, cands, n);
    if (rc != KM_OK)
        return rc;
    state->last_error[0] = '\0';

    km_policy_decision d;
    memset(&d, 0, sizeof d);
    d.owner = find_owner(cands, n);
    d.owner_depth = d.owner == KM_POLICY_NO_OWNER ? 0 : cands[d.owner].depth;
    d.match_ratio = req->n_blocks ? (double)d.owner_depth / (double)req->n_blocks : 0.0;
    d.warm_up = KM_POLICY_NO_WARM_UP;

    switch (cfg->kind) {
    case KM_POLICY_KV:
        decide_kv(cfg, state, req, cands, n, &d, costs_out);
        break;
    case KM_POLICY_CACHE_AWARE:
        decide_cache_aware(cfg, cands, n, &d, costs_out);
        break;
    case KM_POLICY_PREFIX:
        if (costs_out)
            for (uint32_t i = 0; i < n; i++)
                costs_out[i] = (double)(req->n_blocks - cands[i].depth);
        if (d.owner != KM_POLICY_NO_OWNER) {
            d.chosen = d.owner;
            d.reason = KM_POLICY_REASON_DEEPEST_MATCH;
        } else {
            d.chosen = least_loaded(cands, n);
            d.reason = KM_POLICY_REASON_NO_MATCH;
        }
        d.chosen_cost = (double)(req->n_blocks - cands[d.chosen].depth);
        break;
    case KM_POLICY_LEAST_LOAD:
        if (costs_out)
            for (uint32_t i = 0; i < n; i++)
                costs_out[i] = (double)cands[i].in_flight;
        d.chosen = least_loaded(cands, n);
        d.chosen_cost = (double)cands[d.chosen].in_flight;
        d.reason = KM_POLICY_REASON_LEAST_LOAD;
        break;
    case KM_POLICY_ROUND_ROBIN:
        if (costs_out) /* it compares nothing: no cost (null in records, nil on the wire) */
            for (uint32_t i = 0; i < n; i++)
                costs_out[i] = NAN;
        d.chosen = (uint32_t)(state->round_robin_cursor % n);
        state->round_robin_cursor++;
        d.chosen_cost = NAN;
        d.reason = KM_POLICY_REASON_ROUND_ROBIN;
        break;
    case KM_POLICY_LLMD:
        decide_llmd(cfg, req, cands, n, &d, costs_out);
        break;
    case KM_POLICY_PREBLE:
        decide_preble(cfg, req, cands, n, &d, costs_out);
        break;
    case KM_POLICY_TTFT:
        decide_ttft(cfg, req, cands, n, &d, costs_out);
        break;
    case KM_POLICY_KIND_COUNT:
        break;
    }
    d.chosen_depth = cands[d.chosen].depth;
    d.chosen_predicted_ttft_ms = predicted_ttft_us(cfg, req, &cands[d.chosen]) / 1000.0;
    *out = d;
    return KM_OK;
}
