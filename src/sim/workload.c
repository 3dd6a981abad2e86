/* Workloads for `kvmatch sim` (src/sim/workload.h). */
#include "sim/workload.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"
#include "base/error_detail.h"

void km_sim_generator_config_init(km_sim_generator_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->seed = 1;
    cfg->requests = 600;
    cfg->rate_per_s = 8.0;
    cfg->system_prompts = 4;
    cfg->system_prompt_ids_max = 4;
    cfg->session_share = 0.7;
    cfg->turns_max = 6;
    cfg->think_time_s = 2.0;
    cfg->user_ids_max = 3;
    cfg->output_tokens_mean = 350;
    cfg->max_input_ids = 32;
}

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t next_u64(rng *r)
{
    uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double next_unit(rng *r)
{
    return (double)(next_u64(r) >> 11) * (1.0 / 9007199254740992.0);
}

static uint32_t between(rng *r, uint32_t lo, uint32_t hi)
{
    return lo + (uint32_t)(next_u64(r) % ((uint64_t)hi - lo + 1));
}

static double exponential(rng *r, double mean)
{
    return mean <= 0 ? 0 : -mean * log(1.0 - next_unit(r));
}

/* One generated request before sorting: its ids live in the staging pool at `offset`. */
typedef struct staged {
    double arrival_s;
    uint64_t order; /* creation order: ties in arrival keep it */
    uint32_t output_tokens;
    size_t offset;
    uint32_t n_ids;
} staged;

typedef struct stage {
    staged *reqs;
    size_t n, cap;
    uint32_t *pool;
    size_t n_pool, cap_pool;
} stage;

static int stage_add(stage *st, double arrival_s, uint32_t output_tokens, const uint32_t *ids,
                     uint32_t n_ids)
{
    if (st->n == st->cap) {
        size_t cap = st->cap ? st->cap * 2 : 256;
        staged *g = realloc(st->reqs, cap * sizeof *g);
        if (!g)
            return KM_ERR_OUT_OF_MEMORY;
        st->reqs = g;
        st->cap = cap;
    }
    if (st->n_pool + n_ids > st->cap_pool) {
        size_t cap = st->cap_pool ? st->cap_pool : 4096;
        while (cap < st->n_pool + n_ids)
            cap *= 2;
        uint32_t *g = realloc(st->pool, cap * sizeof *g);
        if (!g)
            return KM_ERR_OUT_OF_MEMORY;
        st->pool = g;
        st->cap_pool = cap;
    }
    memcpy(st->pool + st->n_pool, ids, n_ids * sizeof *ids);
    st->reqs[st->n] = (staged){arrival_s, st->n, output_tokens, st->n_pool, n_ids};
    st->n++;
    st->n_pool += n_ids;
    return KM_OK;
}

static int by_arrival(const void *a, const void *b)
{
    const staged *x = a, *y = b;
    if (x->arrival_s != y->arrival_s)
        return x->arrival_s < y->arrival_s ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

static uint32_t draw_output(rng *r, uint32_t mean)
{
    /* Geometric-like: exponential rounded up, at least 1, at most 8x the mean. */
    double x = ceil(exponential(r, (double)mean));
    if (x < 1)
        x = 1;
    if (x > 8.0 * mean)
        x = 8.0 * mean;
    return (uint32_t)x;
}

int km_sim_generate_trace(const km_sim_generator_config *cfg, km_trace *out, char *why,
                          size_t why_size)
{
    if (!cfg || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or out is NULL");
    memset(out, 0, sizeof *out);
    if (cfg->requests == 0 || !(cfg->rate_per_s > 0) || cfg->system_prompts == 0 ||
        cfg->system_prompt_ids_max == 0 || !(cfg->session_share >= 0 && cfg->session_share <= 1) ||
        cfg->turns_max < 2 || !(cfg->think_time_s >= 0) || cfg->user_ids_max == 0 ||
        cfg->output_tokens_mean == 0 || cfg->max_input_ids < cfg->system_prompt_ids_max + 1)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "generator: requests, rate_per_s, system_prompts, system_prompt_ids_max, "
                      "user_ids_max, output_tokens_mean must be >= 1 (rate > 0), session_share in "
                      "0..1, turns_max >= 2, think_time_s >= 0, max_input_ids > "
                      "system_prompt_ids_max");
    rng r = {cfg->seed ^ UINT64_C(0x6b766d73696d)};
    uint32_t next_id = 0;
    /* System prompts: ids allocated first, so they are the smallest. */
    uint32_t *sys_ids = calloc(cfg->system_prompts, sizeof *sys_ids);
    uint32_t *sys_len = calloc(cfg->system_prompts, sizeof *sys_len);
    double *sys_weight = calloc(cfg->system_prompts, sizeof *sys_weight);
    uint32_t *ids = malloc((cfg->max_input_ids + 1) * sizeof *ids);
    stage st = {0};
    int rc = sys_ids && sys_len && sys_weight && ids ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    double total_weight = 0;
    for (uint32_t k = 0; !rc && k < cfg->system_prompts; k++) {
        sys_ids[k] = next_id;
        sys_len[k] = between(&r, 1, cfg->system_prompt_ids_max);
        next_id += sys_len[k];
        sys_weight[k] = 1.0 / (k + 1); /* Zipf, s = 1 */
        total_weight += sys_weight[k];
    }
    double clock_s = 0;
    while (!rc && st.n < cfg->requests) {
        clock_s += exponential(&r, 1.0 / cfg->rate_per_s);
        /* The system prompt. */
        double pick = next_unit(&r) * total_weight;
        uint32_t k = 0;
        while (k + 1 < cfg->system_prompts && pick >= sys_weight[k]) {
            pick -= sys_weight[k];
            k++;
        }
        uint32_t n = 0;
        for (uint32_t i = 0; i < sys_len[k]; i++)
            ids[n++] = sys_ids[k] + i;
        bool session = next_unit(&r) < cfg->session_share;
        uint32_t turns = session ? between(&r, 2, cfg->turns_max) : 1;
        double arrival = clock_s;
        for (uint32_t t = 0; t < turns && !rc; t++) {
            uint32_t user = between(&r, 1, cfg->user_ids_max);
            if (n + user > cfg->max_input_ids)
                break; /* the conversation no longer fits the context: it ends */
            for (uint32_t i = 0; i < user; i++)
                ids[n++] = next_id++;
            uint32_t output = draw_output(&r, cfg->output_tokens_mean);
            rc = stage_add(&st, arrival, output, ids, n);
            /* The next turn: this answer becomes part of the prompt (its ids: one per 512 tokens,
             * at least one), after the user reads it: an assumed 20 ms per answer token plus an
             * exponential think time. */
            uint32_t answer = (output + KM_SIM_TOKENS_PER_ID - 1) / KM_SIM_TOKENS_PER_ID;
            if (n + answer > cfg->max_input_ids)
                break;
            for (uint32_t i = 0; i < answer; i++)
                ids[n++] = next_id++;
            arrival += output * 0.020 + exponential(&r, cfg->think_time_s);
        }
    }
    free(sys_ids);
    free(sys_len);
    free(sys_weight);
    free(ids);
    if (!rc) {
        qsort(st.reqs, st.n, sizeof *st.reqs, by_arrival);
        size_t keep = st.n < cfg->requests ? st.n : cfg->requests;
        size_t pool = 0;
        for (size_t i = 0; i < keep; i++)
            pool += st.reqs[i].n_ids;
        out->requests = calloc(keep ? keep : 1, sizeof *out->requests);
        out->id_pool = malloc((pool ? pool : 1) * sizeof *out->id_pool);
        if (!out->requests || !out->id_pool) {
            rc = KM_ERR_OUT_OF_MEMORY;
        } else {
            size_t at = 0;
            for (size_t i = 0; i < keep; i++) {
                const staged *s = &st.reqs[i];
                memcpy(out->id_pool + at, st.pool + s->offset, s->n_ids * sizeof *out->id_pool);
                km_trace_request *q = &out->requests[i];
                q->timestamp_ms = (uint64_t)llround(s->arrival_s * 1000.0);
                q->input_length = s->n_ids * KM_SIM_TOKENS_PER_ID;
                q->output_length = s->output_tokens;
                q->n_ids = s->n_ids;
                q->ids = out->id_pool + at;
                at += s->n_ids;
            }
            out->n_requests = keep;
            out->n_ids = pool;
        }
    }
    free(st.reqs);
    free(st.pool);
    if (rc) {
        km_trace_free(out);
        return km_why(why, why_size, rc, "generator: out of memory");
    }
    return KM_OK;
}

int km_sim_trace_trim(km_trace *trace, size_t max_requests, double time_scale)
{
    if (!trace)
        return KM_ERR_NULL_POINTER;
    if (!(time_scale > 0))
        return KM_ERR_INVALID_ARGUMENT;
    if (max_requests && trace->n_requests > max_requests)
        trace->n_requests = max_requests;
    if (time_scale == 1.0)
        return KM_OK;
    /* Scaled arrivals stay within the trace limit, so llround is defined and the clock holds them. */
    for (size_t i = 0; i < trace->n_requests; i++)
        if (!((double)trace->requests[i].timestamp_ms * time_scale <=
              (double)KM_TRACE_MAX_TIMESTAMP_MS))
            return KM_ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < trace->n_requests; i++)
        trace->requests[i].timestamp_ms =
            (uint64_t)llround((double)trace->requests[i].timestamp_ms * time_scale);
    return KM_OK;
}
