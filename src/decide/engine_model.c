/* SPDX-License-Identifier: Apache-2.0 */
/* The engine model (include/kvmatch/engine_model.h): step time, presets, and the predicted time to
 * first token the `ttft` policy minimises. */
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kvmatch/engine_model.h"
#include "base/error_detail.h"

typedef struct preset {
    const char *name;
    const char *summary;
    km_engine_model model;
} preset;

/* Each value and its source: docs/SIM_ENGINE.md, "Presets". */
static const preset presets[] = {
    {
        "llama3-8b-h100",
        "Llama-3.1-8B, bf16, one H100 80GB SXM, vLLM v1 serving defaults",
        {
            .block_size = 16,
            .capacity_blocks = 27000,
            .max_num_batched_tokens = 8192,
            .max_num_seqs = 1024,
            .step_floor_us = 7000.0,
            .token_us = 21.4,
            .prefill_us_per_pair = 0.00123,
            .decode_us_per_request = 10.0,
            .decode_us_per_context_token = 0.048,
            .host_load_us_per_block = 40.0,
            .disk_load_us_per_block = 400.0,
        },
    },
    {
        "llama3-70b-h100x4",
        "Llama-3.1-70B, bf16, four H100 80GB SXM (tensor parallel 4), vLLM v1 serving defaults",
        {
            .block_size = 16,
            .capacity_blocks = 29000,
            .max_num_batched_tokens = 8192,
            .max_num_seqs = 1024,
            .step_floor_us = 17000.0,
            .token_us = 65.6,
            .prefill_us_per_pair = 0.00154,
            .decode_us_per_request = 30.0,
            .decode_us_per_context_token = 0.031,
            .host_load_us_per_block = 25.0,
            .disk_load_us_per_block = 250.0,
        },
    },
};
#define N_PRESETS (sizeof presets / sizeof presets[0])

static const preset *find_preset(const char *name)
{
    for (size_t i = 0; name && i < N_PRESETS; i++)
        if (strcmp(presets[i].name, name) == 0)
            return &presets[i];
    return NULL;
}

void km_engine_model_init(km_engine_model *out)
{
    if (out)
        *out = find_preset(KM_ENGINE_MODEL_DEFAULT_PRESET)->model;
}

const char *km_engine_model_preset_name(size_t i)
{
    return i < N_PRESETS ? presets[i].name : NULL;
}

const char *km_engine_model_preset_summary(const char *name)
{
    const preset *p = find_preset(name);
    return p ? p->summary : NULL;
}

/* same_model compares every field: a new one must be added there. */
_Static_assert(sizeof(km_engine_model) == 4 * sizeof(uint32_t) + 7 * sizeof(double),
               "km_engine_model's fields are those same_model compares");

static bool same_model(const km_engine_model *a, const km_engine_model *b)
{
    return a->block_size == b->block_size && a->capacity_blocks == b->capacity_blocks &&
           a->max_num_batched_tokens == b->max_num_batched_tokens &&
           a->max_num_seqs == b->max_num_seqs && a->step_floor_us == b->step_floor_us &&
           a->token_us == b->token_us && a->prefill_us_per_pair == b->prefill_us_per_pair &&
           a->decode_us_per_request == b->decode_us_per_request &&
           a->decode_us_per_context_token == b->decode_us_per_context_token &&
           a->host_load_us_per_block == b->host_load_us_per_block &&
           a->disk_load_us_per_block == b->disk_load_us_per_block;
}

const char *km_engine_model_preset_of(const km_engine_model *m)
{
    for (size_t i = 0; m && i < N_PRESETS; i++)
        if (same_model(&presets[i].model, m))
            return presets[i].name;
    return NULL;
}

int km_engine_model_preset(const char *name, km_engine_model *out)
{
    if (!name || !out)
        return KM_ERR_NULL_POINTER;
    const preset *p = find_preset(name);
    if (!p)
        return KM_ERR_NOT_FOUND;
    *out = p->model;
    return KM_OK;
}

int km_engine_model_validate(const km_engine_model *m, char *why, size_t why_size)
{
    if (!m)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "engine model is NULL");
    if (m->block_size == 0)
        return km_why(why, why_size, KM_ERR_BLOCK_SIZE, "block_size must be at least 1");
    static const struct {
        const char *name;
        size_t offset;
    } limits[] = {
        {"capacity_blocks", offsetof(km_engine_model, capacity_blocks)},
        {"max_num_batched_tokens", offsetof(km_engine_model, max_num_batched_tokens)},
        {"max_num_seqs", offsetof(km_engine_model, max_num_seqs)},
    };
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        uint32_t v;
        memcpy(&v, (const char *)m + limits[i].offset, sizeof v);
        if (v == 0)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "%s must be at least 1",
                          limits[i].name);
    }
    static const struct {
        const char *name;
        size_t offset;
    } times[] = {
        {"step_floor_us", offsetof(km_engine_model, step_floor_us)},
        {"token_us", offsetof(km_engine_model, token_us)},
        {"prefill_us_per_pair", offsetof(km_engine_model, prefill_us_per_pair)},
        {"decode_us_per_request", offsetof(km_engine_model, decode_us_per_request)},
        {"decode_us_per_context_token", offsetof(km_engine_model, decode_us_per_context_token)},
        {"host_load_us_per_block", offsetof(km_engine_model, host_load_us_per_block)},
        {"disk_load_us_per_block", offsetof(km_engine_model, disk_load_us_per_block)},
    };
    for (size_t i = 0; i < sizeof times / sizeof times[0]; i++) {
        double v;
        memcpy(&v, (const char *)m + times[i].offset, sizeof v);
        if (isnan(v) || v < 0.0 || v > KM_ENGINE_MODEL_TIME_MAX)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "%s must lie in [0, %g] (got %g)",
                          times[i].name, KM_ENGINE_MODEL_TIME_MAX, v);
    }
    return KM_OK;
}

/* The step without its prefill attention term. */
static double step_linear_us(const km_engine_model *m, uint64_t prefill_tokens, uint32_t decodes,
                             uint64_t decode_context)
{
    double linear = m->token_us * (double)(prefill_tokens + decodes);
    return (linear > m->step_floor_us ? linear : m->step_floor_us) +
           m->decode_us_per_request * (double)decodes +
           m->decode_us_per_context_token * (double)decode_context;
}

double km_engine_model_step_us(const km_engine_model *m, const km_engine_step *s)
{
    return step_linear_us(m, s->prefill_tokens, s->decode_requests, s->decode_context_tokens) +
           m->prefill_us_per_pair * (double)s->prefill_pairs;
}

static uint64_t add_saturating(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static uint64_t mul_saturating(uint64_t a, uint64_t b)
{
    return b && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

uint64_t km_engine_model_chunk_pairs(uint64_t before, uint64_t chunk)
{
    /* chunk * (chunk + 1) / 2 with its even factor halved first: no product is larger than the
     * result, and chunk + 1 is formed only when chunk is even (so below UINT64_MAX). */
    uint64_t own = chunk % 2 == 0 ? mul_saturating(chunk / 2, chunk + 1)
                                  : mul_saturating(chunk, chunk / 2 + 1);
    return add_saturating(mul_saturating(chunk, before), own);
}

double km_engine_model_step_in_progress_us(const km_engine_model *m, const km_engine_load *load)
{
    if (!load || (!load->decode_requests && !load->prefill_tokens))
        return 0.0;
    uint64_t chunk = load->prefill_tokens < m->max_num_batched_tokens ? load->prefill_tokens
                                                                       : m->max_num_batched_tokens;
    return 0.5 * step_linear_us(m, chunk, load->decode_requests, load->decode_context_tokens);
}

double km_engine_model_predict_ttft_us(const km_engine_model *m, const km_engine_load *load,
                                       uint64_t cached_tokens, uint64_t uncached_tokens,
                                       uint32_t host_blocks, uint32_t disk_blocks,
                                       uint64_t request_blocks, uint64_t output_tokens)
{
    static const km_engine_load idle;
    if (!load)
        load = &idle;
    uint32_t decodes = load->decode_requests;
    uint64_t per_step = m->max_num_batched_tokens > decodes ? m->max_num_batched_tokens - decodes : 1;
    uint64_t tokens = add_saturating(load->prefill_tokens, uncached_tokens);
    uint64_t full = tokens / per_step, rest = tokens % per_step;
    double full_step = step_linear_us(m, per_step, decodes, load->decode_context_tokens);
    double ttft = (double)full * full_step;
    if (rest || !full)
        ttft += step_linear_us(m, rest, decodes, load->decode_context_tokens);
    /* The request's own attention after its cached prefix; chunking does not change the pairs
     * (each token attends to every token before it). */
    ttft += m->prefill_us_per_pair * ((double)load->prefill_pairs +
                                      (double)km_engine_model_chunk_pairs(cached_tokens, uncached_tokens));
    ttft += m->host_load_us_per_block * host_blocks + m->disk_load_us_per_block * disk_blocks;
    /* Memory: the running requests free their blocks as they end; taken to be halfway through an
     * output as long as this request's, they free used_blocks per (output_tokens / 2) decode
     * steps, so the deficit takes deficit * (output_tokens / 2) / used_blocks steps. */
    uint64_t used = load->used_blocks + request_blocks;
    if (load->used_blocks && used > m->capacity_blocks) {
        double deficit = (double)(used - m->capacity_blocks);
        double left = output_tokens > 2 ? (double)output_tokens / 2.0 : 1.0;
        ttft += ceil(deficit * left / (double)load->used_blocks) *
                step_linear_us(m, 0, decodes, load->decode_context_tokens);
    }
    return ttft;
}
