/* SPDX-License-Identifier: Apache-2.0 */
/* A model of one inference engine's speed and memory: what a step of vLLM v1's scheduler costs,
 * how many tokens a step may schedule, how many KV blocks the engine has, and, from those, how
 * long a request would wait for its first token on a worker in a given state.
 *
 * Two users share it, so they never disagree: the simulated engines of `kvmatch sim` run their
 * steps on it (docs/SIM_ENGINE.md), and the `ttft` policy predicts time to first token with it
 * (include/kvmatch/policy.h). Named presets describe real model / GPU configurations, each value
 * from a published measurement (docs/SIM_ENGINE.md lists the sources).
 *
 * Step time. One step runs one forward pass over every token the scheduler picked: each running
 * decode contributes one token, each prefill a chunk of its prompt. With
 *   P = prefill tokens in the step, A = attention pairs of those chunks (a chunk of c tokens after
 *   k tokens of its prompt already in the cache attends to c * k + c * (c + 1) / 2 pairs),
 *   D = decoding requests, C = their context tokens (prompt + generated so far),
 *   step_us = max(step_floor_us, token_us * (P + D))      the linear layers: reading the weights
 *                                                         once, or computing, whichever is longer
 *             + prefill_us_per_pair * A                   prefill attention
 *             + decode_us_per_request * D                 per-sequence work of a decode
 *             + decode_us_per_context_token * C           decode attention: reading the KV cache
 *
 * Pure functions: no handle, no allocation, no I/O, no clock. */
#ifndef KVMATCH_ENGINE_MODEL_H
#define KVMATCH_ENGINE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest value of each time constant (microseconds per step, token, pair, request, context
 * token or block): far past any engine, and small enough that every time the model predicts from
 * counts of up to 2^64 stays finite (so a policy's costs and predictions are never infinite or
 * NaN). */
#define KM_ENGINE_MODEL_TIME_MAX 1e9

typedef struct km_engine_model {
    /* ---- memory and scheduler limits (vLLM's names) ---- */
    uint32_t block_size;             /* tokens per KV block, >= 1: the unit of capacity_blocks,
                                      * of every block count in km_engine_load and of the
                                      * per-block load times below (the policies convert a
                                      * request's blocks of another size to it) */
    uint32_t capacity_blocks;        /* KV blocks of one engine (all GPUs of a replica), >= 1 */
    uint32_t max_num_batched_tokens; /* tokens one step may schedule (the chunked-prefill budget;
                                      * each decode takes one), >= 1 */
    uint32_t max_num_seqs;           /* requests running at once (prefilling or decoding), >= 1 */
    /* ---- step time, microseconds (formula above); each 0 .. KM_ENGINE_MODEL_TIME_MAX ---- */
    double step_floor_us;
    double token_us;
    double prefill_us_per_pair;
    double decode_us_per_request;
    double decode_us_per_context_token;
    /* ---- bringing KV back from lower tiers before a prefill can use it; each
     * 0 .. KM_ENGINE_MODEL_TIME_MAX ---- */
    double host_load_us_per_block;   /* a block held in host memory, copied back over PCIe */
    double disk_load_us_per_block;   /* a block held on local disk */
} km_engine_model;

/* The shape of one step (see the formula above). */
typedef struct km_engine_step {
    uint64_t prefill_tokens;
    uint64_t prefill_pairs;
    uint32_t decode_requests;
    uint64_t decode_context_tokens;
} km_engine_step;

/* A worker's state as a router sees it: what is queued or running there. */
typedef struct km_engine_load {
    uint64_t prefill_tokens;   /* prompt tokens still to prefill (uncached) of requests routed
                                * there whose first token has not come */
    uint32_t prefill_requests; /* those requests */
    uint32_t decode_requests;  /* requests past their first token, still generating */
    uint64_t decode_context_tokens; /* their context (prompt + output so far); 0 = unknown */
    uint64_t used_blocks;      /* KV blocks the running and queued requests take; 0 = unknown */
    uint64_t prefill_pairs;    /* the attention pairs of those prefills, each after its own cached
                                * prefix (km_engine_model_chunk_pairs); 0 = unknown */
} km_engine_load;

/* Fills *out with the default preset (KM_ENGINE_MODEL_DEFAULT_PRESET). */
void km_engine_model_init(km_engine_model *out);

#define KM_ENGINE_MODEL_DEFAULT_PRESET "llama3-8b-h100"

/* The named configurations, for `--engine` listings: the i-th preset's name, NULL past the last. */
const char *km_engine_model_preset_name(size_t i);
/* A short description of the named preset (model, GPUs, serving settings); NULL when unknown. */
const char *km_engine_model_preset_summary(const char *name);
/* Fills *out with the named preset. KM_ERR_NULL_POINTER, or KM_ERR_NOT_FOUND for an unknown name
 * (*out untouched). */
int km_engine_model_preset(const char *name, km_engine_model *out);
/* The name of the preset whose every parameter equals *m's; NULL when none does (or m is NULL). */
const char *km_engine_model_preset_of(const km_engine_model *m);

/* KM_OK, or KM_ERR_NULL_POINTER / KM_ERR_BLOCK_SIZE (block_size 0) / KM_ERR_INVALID_ARGUMENT (a
 * limit of 0, a time constant NaN, negative or over KM_ENGINE_MODEL_TIME_MAX) with a sentence
 * naming the field in why (why may be NULL). */
int km_engine_model_validate(const km_engine_model *m, char *why, size_t why_size);

/* The duration of a step of this shape, in microseconds (the formula above, not rounded). */
double km_engine_model_step_us(const km_engine_model *m, const km_engine_step *step);

/* Attention pairs of a prefill chunk of `chunk` tokens after `before` tokens of the same prompt:
 * chunk * before + chunk * (chunk + 1) / 2, or UINT64_MAX when that does not fit in 64 bits (so
 * it never decreases as either argument grows). */
uint64_t km_engine_model_chunk_pairs(uint64_t before, uint64_t chunk);

/* The time a request would wait for its first token on a worker in state *load, in microseconds,
 * when `cached_tokens` of its prompt are already there (of which `host_blocks` and `disk_blocks`
 * blocks must first be brought back from lower tiers) and `uncached_tokens` must be prefilled;
 * `request_blocks` is the KV the request takes (prompt and output).
 *
 * The worker is assumed to serve as vLLM v1 does: first come, first served, each decode taking one
 * token of every step's budget, so prefills advance by at most max(max_num_batched_tokens - D, 1)
 * tokens a step. The queued prefill tokens go first, then the request's own:
 *   steps   = the full steps and the last partial one that prefill load->prefill_tokens +
 *             uncached_tokens tokens beside D decodes, each timed by km_engine_model_step_us
 *             without its attention term,
 *   ttft_us = the sum of those steps
 *             + prefill_us_per_pair * (load->prefill_pairs, the queued prefills' attention pairs,
 *               + the request's own attention pairs after cached_tokens)
 *             + host_blocks * host_load_us_per_block + disk_blocks * disk_load_us_per_block
 *             + a memory wait when used_blocks + request_blocks exceed capacity_blocks: the
 *               running requests, taken to be halfway through an output of output_tokens, free
 *               used_blocks every output_tokens / 2 decode steps; the deficit waits its share.
 * Monotonic: more queued tokens or pairs, more decodes or fewer cached tokens never predict
 * less. */
double km_engine_model_predict_ttft_us(const km_engine_model *m, const km_engine_load *load,
                                       uint64_t cached_tokens, uint64_t uncached_tokens,
                                       uint32_t host_blocks, uint32_t disk_blocks,
                                       uint64_t request_blocks, uint64_t output_tokens);

/* The time a request arriving at a worker in state *load waits for the step the worker is running
 * to end, in microseconds, on average: half of one step of min(load->prefill_tokens,
 * max_num_batched_tokens) prefill tokens beside its decodes (km_engine_model_step_us without the
 * attention term), and 0 when the worker has neither (idle) or load is NULL. Arrivals fall at
 * random points of a step, and the queue replay of km_engine_model_predict_ttft_us starts at a
 * step boundary; a predicted time to first token on a busy worker is the sum of the two. */
double km_engine_model_step_in_progress_us(const km_engine_model *m, const km_engine_load *load);

#ifdef __cplusplus
}
#endif
#endif
