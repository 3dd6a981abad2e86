/* SPDX-License-Identifier: Apache-2.0 */
/* Workloads for `kvmatch sim` (src/sim/workload.h). */
#include "sim/workload.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"
#include "base/array.h"
#include "base/error_detail.h"
#include "base/u64_map.h"

static const char *const shape_names[KM_SIM_SHAPE_COUNT] = {
#define KM_SIM_SHAPE_NAME(value, name) [value] = name,
    KM_SIM_SHAPE_LIST(KM_SIM_SHAPE_NAME)
#undef KM_SIM_SHAPE_NAME
};

const char *km_sim_shape_name(km_sim_shape shape)
{
    return (unsigned)shape < KM_SIM_SHAPE_COUNT ? shape_names[shape] : "unknown";
}

int km_sim_shape_parse(const char *name, km_sim_shape *out)
{
    if (!name || !out)
        return KM_ERR_NULL_POINTER;
    for (unsigned k = 0; k < KM_SIM_SHAPE_COUNT; k++)
        if (strcmp(name, shape_names[k]) == 0) {
            *out = (km_sim_shape)k;
            return KM_OK;
        }
    return KM_ERR_INVALID_ARGUMENT;
}

int km_sim_generator_config_shape(km_sim_shape shape, km_sim_generator_config *cfg)
{
    if (!cfg)
        return KM_ERR_NULL_POINTER;
    if ((unsigned)shape >= KM_SIM_SHAPE_COUNT)
        return KM_ERR_INVALID_ARGUMENT;
    memset(cfg, 0, sizeof *cfg);
    cfg->shape = shape;
    cfg->seed = 1;
    cfg->requests = 600;
    cfg->prefix_zipf = 1.0;
    switch (shape) {
    case KM_SIM_SHAPE_CHAT:
        cfg->rate_per_s = 8.0;
        cfg->prefixes = 4;
        cfg->prefix_tokens_min = 512;
        cfg->prefix_tokens_max = 2048;
        cfg->session_share = 0.7;
        cfg->turns_min = 2;
        cfg->turns_max = 6;
        cfg->think_time_s = 2.0;
        cfg->new_tokens_min = 100;
        cfg->new_tokens_max = 1500;
        cfg->output_tokens_mean = 350;
        cfg->max_input_tokens = 16384;
        break;
    case KM_SIM_SHAPE_SYSTEM_PROMPT:
        cfg->rate_per_s = 12.0;
        cfg->prefixes = 8;
        cfg->prefix_tokens_min = 2000;
        cfg->prefix_tokens_max = 6000;
        cfg->session_share = 0.0;
        cfg->turns_min = 2;
        cfg->turns_max = 2;
        cfg->new_tokens_min = 50;
        cfg->new_tokens_max = 500;
        cfg->output_tokens_mean = 200;
        cfg->max_input_tokens = 16384;
        break;
    case KM_SIM_SHAPE_AGENT:
        cfg->rate_per_s = 1.0;
        cfg->prefixes = 2;
        cfg->prefix_tokens_min = 3000;
        cfg->prefix_tokens_max = 5000;
        cfg->session_share = 1.0;
        cfg->turns_min = 8;
        cfg->turns_max = 24;
        cfg->think_time_s = 1.0;
        cfg->new_tokens_min = 200;
        cfg->new_tokens_max = 2000;
        cfg->output_tokens_mean = 120;
        cfg->max_input_tokens = 32768;
        break;
    case KM_SIM_SHAPE_DOCQA:
        cfg->rate_per_s = 10.0;
        cfg->common_tokens = 512;
        cfg->prefixes = 32;
        cfg->prefix_tokens_min = 4000;
        cfg->prefix_tokens_max = 12000;
        cfg->prefix_zipf = 0.8;
        cfg->session_share = 0.0;
        cfg->turns_min = 2;
        cfg->turns_max = 2;
        cfg->new_tokens_min = 30;
        cfg->new_tokens_max = 300;
        cfg->output_tokens_mean = 80;
        cfg->max_input_tokens = 32768;
        break;
    default:
        break;
    }
    return KM_OK;
}

void km_sim_generator_config_init(km_sim_generator_config *cfg)
{
    km_sim_generator_config_shape(KM_SIM_SHAPE_CHAT, cfg);
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
    uint32_t input_tokens;
    uint32_t answer_tokens; /* of output_tokens, those its ids cover (a next turn's re-sent) */
    size_t offset;
    uint32_t n_ids;
    uint64_t previous; /* the order of the session's previous turn; UINT64_MAX: none */
} staged;

typedef struct stage {
    staged *reqs;
    size_t n, cap;
    uint32_t *pool;
    size_t n_pool, cap_pool;
} stage;

static int stage_add(stage *st, double arrival_s, uint32_t output_tokens, const uint32_t *ids,
                     uint32_t n_ids, uint32_t input_tokens, uint32_t answer_tokens,
                     uint64_t previous)
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
    st->reqs[st->n] = (staged){arrival_s,     st->n,      output_tokens, input_tokens,
                               answer_tokens, st->n_pool, n_ids,         previous};
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

/* A prompt under construction: `tokens` tokens over the ids that cover them. Growing it uses the
 * last id further before adding fresh ones, so the old prompt stays a prefix of the new. */
typedef struct prompt {
    uint32_t *ids;
    uint32_t n_ids, cap_ids;
    uint32_t tokens;
} prompt;

static void prompt_append(prompt *p, uint32_t tokens, const uint32_t *from_ids, uint32_t *next_id)
{
    uint32_t target = p->tokens + tokens;
    uint32_t need = (target + KM_SIM_TOKENS_PER_ID - 1) / KM_SIM_TOKENS_PER_ID;
    for (uint32_t i = 0; p->n_ids < need && p->n_ids < p->cap_ids; i++)
        p->ids[p->n_ids++] = from_ids ? from_ids[i] : (*next_id)++;
    p->tokens = target;
}

static int check_config(const km_sim_generator_config *c, char *why, size_t why_size)
{
    const char *bad = NULL;
    if ((unsigned)c->shape >= KM_SIM_SHAPE_COUNT)
        bad = "shape is unknown";
    else if (c->requests == 0)
        bad = "requests must be >= 1";
    else if (!(c->rate_per_s > 0) || !isfinite(c->rate_per_s))
        bad = "rate_per_s must be > 0";
    else if (c->prefixes == 0 || c->prefix_tokens_min == 0 ||
             c->prefix_tokens_min > c->prefix_tokens_max)
        bad = "prefixes and prefix_tokens_min must be >= 1, prefix_tokens_min <= prefix_tokens_max";
    else if (c->common_tokens % KM_SIM_TOKENS_PER_ID)
        bad = "common_tokens must be a multiple of 512 (whole ids)";
    else if (!(c->prefix_zipf >= 0) || !isfinite(c->prefix_zipf))
        bad = "prefix_zipf must be >= 0";
    else if (!(c->session_share >= 0 && c->session_share <= 1))
        bad = "session_share must be in 0..1";
    else if (c->turns_min < 2 || c->turns_min > c->turns_max)
        bad = "turns_min must be >= 2 and <= turns_max";
    else if (!(c->think_time_s >= 0) || !isfinite(c->think_time_s))
        bad = "think_time_s must be >= 0";
    else if (c->new_tokens_min == 0 || c->new_tokens_min > c->new_tokens_max)
        bad = "new_tokens_min must be >= 1 and <= new_tokens_max";
    else if (c->output_tokens_mean == 0)
        bad = "output_tokens_mean must be >= 1";
    else if ((uint64_t)c->max_input_tokens <=
             (uint64_t)c->common_tokens +
                 (c->prefix_tokens_max > KM_SIM_TOKENS_PER_ID ? c->prefix_tokens_max
                                                              : KM_SIM_TOKENS_PER_ID) +
                 c->new_tokens_max)
        bad = "max_input_tokens must exceed common_tokens + max(prefix_tokens_max, 512) + "
              "new_tokens_max";
    return bad ? km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "generator: %s", bad) : KM_OK;
}

int km_sim_generate_trace(const km_sim_generator_config *cfg, km_trace *out, char *why,
                          size_t why_size)
{
    if (!cfg || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or out is NULL");
    memset(out, 0, sizeof *out);
    int rc = check_config(cfg, why, why_size);
    if (rc)
        return rc;
    rng r = {cfg->seed ^ UINT64_C(0x6b766d73696d) ^ ((uint64_t)cfg->shape << 48)};
    uint32_t next_id = 0;
    /* The common header (whole ids), then the shared prefixes: their ids are allocated first, so
     * they are the smallest. Each prefix starts a fresh id, so prefixes share the header only. */
    uint32_t per = KM_SIM_TOKENS_PER_ID;
    uint32_t max_ids = (cfg->max_input_tokens + per - 1) / per + 1;
    uint32_t header_ids = cfg->common_tokens / per;
    uint32_t *header = calloc(header_ids + 1, sizeof *header);
    uint32_t *pre_first = calloc(cfg->prefixes, sizeof *pre_first);
    uint32_t *pre_len = calloc(cfg->prefixes, sizeof *pre_len);
    double *pre_weight = calloc(cfg->prefixes, sizeof *pre_weight);
    prompt p = {malloc((size_t)max_ids * sizeof(uint32_t)), 0, max_ids, 0};
    stage st = {0};
    rc = header && pre_first && pre_len && pre_weight && p.ids ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; !rc && i < header_ids; i++)
        header[i] = next_id++;
    double total_weight = 0;
    for (uint32_t k = 0; !rc && k < cfg->prefixes; k++) {
        /* Whole ids: the text after a prefix starts an id of its own, so requests that share the
         * prefix share nothing of what follows it (an id stands for fixed tokens). */
        uint32_t drawn = between(&r, cfg->prefix_tokens_min, cfg->prefix_tokens_max);
        pre_len[k] = (drawn + per / 2) / per * per;
        if (pre_len[k] > cfg->prefix_tokens_max && pre_len[k] > per)
            pre_len[k] -= per; /* the range's end, not past it */
        if (pre_len[k] == 0)
            pre_len[k] = per;
        pre_first[k] = next_id;
        next_id += (pre_len[k] + per - 1) / per;
        pre_weight[k] = 1.0 / pow((double)(k + 1), cfg->prefix_zipf);
        total_weight += pre_weight[k];
    }
    uint32_t *pre_ids = malloc((size_t)max_ids * sizeof *pre_ids);
    if (!rc && !pre_ids)
        rc = KM_ERR_OUT_OF_MEMORY;
    double clock_s = 0;
    while (!rc && st.n < cfg->requests) {
        clock_s += exponential(&r, 1.0 / cfg->rate_per_s);
        double pick = next_unit(&r) * total_weight;
        uint32_t k = 0;
        while (k + 1 < cfg->prefixes && pick >= pre_weight[k]) {
            pick -= pre_weight[k];
            k++;
        }
        p.n_ids = 0;
        p.tokens = 0;
        prompt_append(&p, cfg->common_tokens, header, &next_id);
        for (uint32_t i = 0; i < max_ids; i++)
            pre_ids[i] = pre_first[k] + i;
        prompt_append(&p, pre_len[k], pre_ids, &next_id);
        bool session = next_unit(&r) < cfg->session_share;
        uint32_t turns = session ? between(&r, cfg->turns_min, cfg->turns_max) : 1;
        double arrival = clock_s;
        for (uint32_t t = 0; t < turns && !rc; t++) {
            uint32_t add = between(&r, cfg->new_tokens_min, cfg->new_tokens_max);
            if ((uint64_t)p.tokens + add > cfg->max_input_tokens)
                break; /* the session no longer fits the context: it ends */
            prompt_append(&p, add, NULL, &next_id);
            uint32_t output = draw_output(&r, cfg->output_tokens_mean);
            /* The next turn re-sends this answer too, after it was generated (an assumed 20 ms
             * per output token) and a think time (a user reading, a tool running); the request's
             * ids cover its answer, so that the engine caches the answer as it generates it. */
            uint32_t input = p.tokens;
            bool resent = (uint64_t)p.tokens + output <= cfg->max_input_tokens;
            if (resent)
                prompt_append(&p, output, NULL, &next_id);
            /* a session's turns are staged one after another: the previous is the last staged */
            rc = stage_add(&st, arrival, output, p.ids, p.n_ids, input, resent ? output : 0,
                           t ? st.n - 1 : UINT64_MAX);
            if (!resent)
                break;
            arrival += output * 0.020 + exponential(&r, cfg->think_time_s);
        }
    }
    free(header);
    free(pre_first);
    free(pre_len);
    free(pre_weight);
    free(pre_ids);
    free(p.ids);
    if (!rc) {
        qsort(st.reqs, st.n, sizeof *st.reqs, by_arrival);
        size_t keep = st.n < cfg->requests ? st.n : cfg->requests;
        size_t pool = 0;
        for (size_t i = 0; i < keep; i++)
            pool += st.reqs[i].n_ids;
        out->requests = calloc(keep ? keep : 1, sizeof *out->requests);
        out->id_pool = malloc((pool ? pool : 1) * sizeof *out->id_pool);
        /* index_of[order]: 1 + a staged request's index in the trace, 0 when not kept */
        uint32_t *index_of = calloc(st.n ? st.n : 1, sizeof *index_of);
        if (!out->requests || !out->id_pool || !index_of) {
            rc = KM_ERR_OUT_OF_MEMORY;
        } else {
            for (size_t i = 0; i < keep; i++)
                index_of[st.reqs[i].order] = (uint32_t)i + 1;
            size_t at = 0;
            for (size_t i = 0; i < keep; i++) {
                const staged *s = &st.reqs[i];
                memcpy(out->id_pool + at, st.pool + s->offset, s->n_ids * sizeof *out->id_pool);
                km_trace_request *q = &out->requests[i];
                q->timestamp_ms = (uint64_t)llround(s->arrival_s * 1000.0);
                q->input_length = s->input_tokens;
                q->output_length = s->output_tokens;
                q->answer_tokens = s->answer_tokens;
                q->n_ids = s->n_ids;
                q->ids = out->id_pool + at;
                /* the previous turn arrived first, so it is kept */
                q->previous_turn = s->previous == UINT64_MAX ? 0 : index_of[s->previous];
                at += s->n_ids;
            }
            out->n_requests = keep;
            out->n_ids = pool;
        }
        free(index_of);
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

double km_sim_arrival_rate(const km_trace *trace)
{
    size_t n = trace ? trace->n_requests : 0;
    if (n < 10)
        return 0;
    size_t lo = n / 10, hi = n - 1 - n / 10;
    double span_s =
        (double)(trace->requests[hi].timestamp_ms - trace->requests[lo].timestamp_ms) / 1000.0;
    return span_s > 0 ? (double)(hi - lo) / span_s : 0;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- the floor ------------------------------------------------------------------------------ */

/* The least time an engine of model m spends computing `tokens` tokens after `before` cached ones,
 * from the first step that holds them, however its steps chunk them and whatever else they hold:
 * a step floor at least, token_us a token, plus their attention pairs. */
static double compute_lower_bound_us(const km_engine_model *m, uint64_t before, uint64_t tokens)
{
    double linear = m->token_us * (double)tokens;
    return (linear > m->step_floor_us ? linear : m->step_floor_us) +
           m->prefill_us_per_pair * (double)km_engine_model_chunk_pairs(before, tokens);
}

/* The least `tokens` tokens after `before` add to a step that other work fills: a step takes the
 * longer of its floor and its tokens' time, so they add their time beyond one floor at least,
 * plus their attention pairs. */
static double joined_lower_bound_us(const km_engine_model *m, uint64_t before, uint64_t tokens)
{
    double beyond = m->token_us * (double)tokens - m->step_floor_us;
    return (beyond > 0 ? beyond : 0) +
           m->prefill_us_per_pair * (double)km_engine_model_chunk_pairs(before, tokens);
}

/* A prefix a request can start from: its first `cached` tokens exist from `at` on (a lower
 * bound). */
typedef struct floor_option {
    uint64_t cached;
    double at;
} floor_option;

/* How long after its arrival a request can have its first x tokens' KV (x <= input_length, x >
 * o->cached), starting from option o, at the earliest. It is scheduled no earlier than its
 * arrival, so the rest takes compute_lower_bound_us from then on; and when o's prefix comes after
 * its arrival, no earlier than o->at plus what the rest adds to the step that completes the
 * prefix (joined_lower_bound_us), which it may join. */
static double after_arrival(const km_engine_model *m, const floor_option *o, double arrival,
                            uint64_t x)
{
    double own = compute_lower_bound_us(m, o->cached, x - o->cached);
    double joined = (o->at - arrival) + joined_lower_bound_us(m, o->cached, x - o->cached);
    return own > joined ? own : joined;
}

typedef struct arrival_order {
    uint64_t timestamp_ms;
    size_t index;
} arrival_order;

static int cmp_arrival(const void *a, const void *b)
{
    const arrival_order *x = a, *y = b;
    if (x->timestamp_ms != y->timestamp_ms)
        return x->timestamp_ms < y->timestamp_ms ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The map key of the prefix that ends after token `end` (1-based) of q's prompt and answer: the id
 * holding that token and where in it the prefix ends (an id stands for its whole prefix). */
static uint64_t prefix_key(const km_trace_request *q, uint64_t end)
{
    uint32_t k = (uint32_t)((end - 1) / KM_SIM_TOKENS_PER_ID);
    uint64_t offset = end - (uint64_t)k * KM_SIM_TOKENS_PER_ID; /* 1 .. KM_SIM_TOKENS_PER_ID */
    return ((uint64_t)q->ids[k] << 10 | offset) + 2;
}

int km_sim_floor_ttft_us(const km_trace *trace, const km_engine_model *model, double *floor_us)
{
    if (!trace || !model || (!floor_us && trace->n_requests))
        return KM_ERR_NULL_POINTER;
    if (model->block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    _Static_assert(KM_SIM_TOKENS_PER_ID < 1024, "an id's offsets fit prefix_key's 10 bits");
    size_t n = trace->n_requests;
    if (n == 0)
        return KM_OK;
    const uint64_t bs = model->block_size;
    arrival_order *order = malloc(n * sizeof *order);
    floor_option *front = NULL;
    size_t front_capacity = 0;
    km_memory memory = {0};
    km_u64map exists; /* prefix_key of a whole block's end -> the earliest it exists (double bits) */
    km_u64map_init(&exists, &memory);
    int rc = order ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    for (size_t i = 0; !rc && i < n; i++)
        order[i] = (arrival_order){trace->requests[i].timestamp_ms, i};
    if (!rc)
        qsort(order, n, sizeof *order, cmp_arrival);
    for (size_t o = 0; !rc && o < n; o++) {
        const km_trace_request *q = &trace->requests[order[o].index];
        double arrival = (double)q->timestamp_ms * 1000.0;
        uint64_t length = q->input_length;
        uint64_t covered = (uint64_t)q->n_ids * KM_SIM_TOKENS_PER_ID;
        /* Refused by every engine (its prompt and output reserve need more blocks than one
         * holds): no first token, no floor, nothing computed. */
        uint64_t output = q->output_length ? q->output_length : 1;
        if ((length + output + bs - 1) / bs > model->capacity_blocks) {
            floor_us[order[o].index] = NAN;
            continue;
        }
        /* The whole blocks of the prompt that exist somewhere, in order, never its last token (an
         * engine's hit rule), each with when it exists; then the options worth weighing: the
         * deepest of those that exist on arrival, and each deeper one that comes before every
         * deeper still (a later and shorter prefix is never the better start). */
        uint64_t cap = (length - 1) / bs * bs;
        if (cap > covered)
            cap = covered / bs * bs;
        if ((rc = KM_ARRAY_GROW(front, front_capacity, 1, 64)))
            break;
        front[0] = (floor_option){0, arrival};
        size_t n_front = 1;
        for (uint64_t end = bs; end <= cap; end += bs) {
            const uint64_t *v = km_u64map_find(&exists, prefix_key(q, end));
            if (!v)
                break;
            double at;
            memcpy(&at, v, sizeof at);
            if ((rc = KM_ARRAY_GROW(front, front_capacity, n_front + 1, 64)))
                break;
            front[n_front++] = (floor_option){end, at > arrival ? at : arrival};
        }
        if (rc)
            break;
        size_t kept = 0;
        double earliest = INFINITY;
        for (size_t j = n_front; j-- > 0;)
            if (front[j].at < earliest) {
                earliest = front[j].at;
                front[kept++] = front[j];
            }
        n_front = kept; /* deepest first */
        double best = INFINITY;
        for (size_t j = 0; j < n_front; j++) {
            double t = after_arrival(model, &front[j], arrival, length);
            best = t < best ? t : best;
        }
        floor_us[order[o].index] = best;
        /* The whole blocks it computes, where it would have them sooner than they exist: its
         * prompt's, then those of the answer it generates (answer_tokens, never the last token,
         * which is never computed), one decode step (a step floor at least) a token from its
         * first token on. */
        uint32_t answered = q->answer_tokens < q->output_length ? q->answer_tokens
                            : q->output_length ? q->output_length - 1 : 0;
        uint64_t left = length + answered;
        if (left > covered)
            left = covered;
        for (uint64_t end = bs; !rc && end <= left; end += bs) {
            double at;
            if (end > length) {
                at = arrival + best + (double)(end - length) * model->step_floor_us;
            } else {
                double soonest = INFINITY;
                for (size_t j = 0; j < n_front; j++) {
                    if (front[j].cached >= end)
                        continue; /* it exists as soon as it found it: nothing sooner */
                    double t = after_arrival(model, &front[j], arrival, end);
                    soonest = t < soonest ? t : soonest;
                }
                at = arrival + soonest;
            }
            uint64_t key = prefix_key(q, end), bits;
            const uint64_t *v = km_u64map_find(&exists, key);
            if (v) {
                double before;
                memcpy(&before, v, sizeof before);
                if (before <= at)
                    continue;
            }
            memcpy(&bits, &at, sizeof bits);
            rc = km_u64map_put(&exists, key, bits, 1);
        }
    }
    km_u64map_free(&exists);
    free(front);
    free(order);
    return rc;
}

int km_sim_workload_stats_of(const km_trace *trace, const km_engine_model *model,
                             km_sim_workload_stats *out)
{
    if (!trace || !model || !out)
        return KM_ERR_NULL_POINTER;
    uint32_t block_size = model->block_size;
    if (block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    memset(out, 0, sizeof *out);
    size_t n = trace->n_requests;
    if (n == 0)
        return KM_OK;
    uint32_t *lengths = malloc(n * sizeof *lengths);
    double *floor_ms = malloc(n * sizeof *floor_ms);
    km_memory memory = {0};
    km_u64map seen; /* id + 2 -> the most tokens of it an earlier prompt or answer used */
    km_u64map_init(&seen, &memory);
    int rc = lengths && floor_ms ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    const uint32_t per = KM_SIM_TOKENS_PER_ID;
    for (size_t i = 0; !rc && i < n; i++) {
        const km_trace_request *q = &trace->requests[i];
        lengths[i] = q->input_length;
        out->prompt_tokens += q->input_length;
        out->output_tokens += q->output_length;
        /* Ids chain: an id seen before stands for its whole prefix. The reuse runs while the ids
         * were seen at least as far as this prompt uses them. */
        uint64_t reusable = 0;
        for (uint32_t k = 0; k < q->n_ids && (uint64_t)k * per < q->input_length; k++) {
            uint32_t used = q->input_length - k * per < per ? q->input_length - k * per : per;
            const uint64_t *v = km_u64map_find(&seen, (uint64_t)q->ids[k] + 2);
            uint32_t before = v ? (uint32_t)*v : 0;
            reusable += before < used ? before : used;
            if (before < used)
                break;
        }
        uint64_t cap = (uint64_t)(q->input_length ? q->input_length - 1 : 0) / block_size * block_size;
        reusable = reusable / block_size * block_size;
        reusable = reusable < cap ? reusable : cap;
        out->reusable_tokens += reusable;
        /* What it leaves cached: its prompt, then the answer it generates (answer_tokens) but
         * its last token, which is never computed (the request ends with it). */
        uint32_t answered = q->answer_tokens < q->output_length ? q->answer_tokens
                            : q->output_length ? q->output_length - 1 : 0;
        uint64_t left = (uint64_t)q->input_length + answered;
        for (uint32_t k = 0; !rc && k < q->n_ids && (uint64_t)k * per < left; k++) {
            uint32_t used = left - (uint64_t)k * per < per ? (uint32_t)(left - (uint64_t)k * per)
                                                           : per;
            uint64_t *v = km_u64map_find(&seen, (uint64_t)q->ids[k] + 2);
            if (v && *v >= used)
                continue;
            rc = km_u64map_put(&seen, (uint64_t)q->ids[k] + 2, used, 1);
        }
    }
    if (!rc)
        rc = km_sim_floor_ttft_us(trace, model, floor_ms);
    if (!rc) {
        for (size_t i = 0; i < n; i++)
            floor_ms[i] /= 1000.0;
        out->requests = n;
        qsort(lengths, n, sizeof *lengths, cmp_u32);
        out->prompt_mean = (double)out->prompt_tokens / (double)n;
        out->prompt_p50 = lengths[(size_t)(0.50 * (double)(n - 1) + 0.5)];
        out->prompt_p99 = lengths[(size_t)(0.99 * (double)(n - 1) + 0.5)];
        /* Over the requests an engine admits (a refused one has no floor: NAN). */
        size_t admitted = 0;
        for (size_t i = 0; i < n; i++)
            if (!isnan(floor_ms[i]))
                floor_ms[admitted++] = floor_ms[i];
        qsort(floor_ms, admitted, sizeof *floor_ms, cmp_double);
        out->floor_ttft_p50_ms =
            admitted ? floor_ms[(size_t)(0.50 * (double)(admitted - 1) + 0.5)] : NAN;
        out->floor_ttft_p99_ms =
            admitted ? floor_ms[(size_t)(0.99 * (double)(admitted - 1) + 0.5)] : NAN;
        out->output_mean = (double)out->output_tokens / (double)n;
        out->reusable_share =
            out->prompt_tokens ? (double)out->reusable_tokens / (double)out->prompt_tokens : 0.0;
        out->span_s = (double)(trace->requests[n - 1].timestamp_ms - trace->requests[0].timestamp_ms) /
                      1000.0;
        out->arrival_rate_per_s = km_sim_arrival_rate(trace);
    }
    km_u64map_free(&seen);
    free(lengths);
    free(floor_ms);
    return rc;
}
