/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: workloads for `kvmatch sim` (docs/SIM.md, "Workloads"). A workload is a km_trace
 * (src/sim/trace.h): requests of hash ids, one id per 512-token chunk, ids acting as chained
 * prefix names, arrival times in ms. It comes from a Mooncake trace file, or from this generator,
 * which draws one of four shapes of prefix sharing:
 *
 *   chat           multi-turn conversations on a few shared system prompts: each turn re-sends
 *                  the conversation so far (its prompt extends the previous turn's with the
 *                  answer and a new user message); some requests are single turns;
 *   system_prompt  many users on a few long system prompts, one turn each;
 *   agent          agent loops: a shared tool prompt and a task, then many steps, each re-sending
 *                  the growing context with the last tool call and its result, after a short
 *                  tool latency;
 *   docqa          few-shot document questions: a shared instruction header, one of many long
 *                  documents (popular ones asked about more often), a short question.
 *
 * Prompts are counted in tokens: a request's last id may be used in part (input_length), and a
 * later prompt that extends it uses that id further, so an earlier prompt's tokens are always a
 * prefix of the prompts that extend it. Token ids come from the ids (km_trace_id_tokens), so
 * equal ids mean equal tokens. Arrivals of sessions and single requests are a Poisson process. */
#ifndef KM_SIM_WORKLOAD_H
#define KM_SIM_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/engine_model.h"
#include "sim/trace.h"

#define KM_SIM_TOKENS_PER_ID KM_TRACE_TOKENS_PER_ID

#define KM_SIM_SHAPE_LIST(X)                                                                       \
    X(KM_SIM_SHAPE_CHAT, "chat")                                                                   \
    X(KM_SIM_SHAPE_SYSTEM_PROMPT, "system_prompt")                                                 \
    X(KM_SIM_SHAPE_AGENT, "agent")                                                                 \
    X(KM_SIM_SHAPE_DOCQA, "docqa")

typedef enum km_sim_shape {
#define KM_SIM_SHAPE_ENUM(value, name) value,
    KM_SIM_SHAPE_LIST(KM_SIM_SHAPE_ENUM)
#undef KM_SIM_SHAPE_ENUM
    KM_SIM_SHAPE_COUNT
} km_sim_shape;

/* "chat", "system_prompt", "agent", "docqa"; "unknown" for other values. */
const char *km_sim_shape_name(km_sim_shape shape);
/* Inverse of km_sim_shape_name: KM_OK, KM_ERR_NULL_POINTER or KM_ERR_INVALID_ARGUMENT. */
int km_sim_shape_parse(const char *name, km_sim_shape *out);

typedef struct km_sim_generator_config {
    km_sim_shape shape;
    uint64_t seed;
    uint32_t requests;          /* total requests; >= 1 */
    double rate_per_s;          /* mean arrival rate of sessions and single requests; > 0 */
    uint32_t common_tokens;     /* every prompt starts with these shared tokens (docqa's
                                 * instruction header); a multiple of 512, may be 0 */
    uint32_t prefixes;          /* shared prefixes to draw from: system prompts, tool prompts or
                                 * documents; >= 1 */
    uint32_t prefix_tokens_min; /* each prefix's length, drawn once in this range and rounded
                                 * to whole 512-token ids (at least one, not past the range's
                                 * end where one fits); >= 1 */
    uint32_t prefix_tokens_max;
    double prefix_zipf;         /* popularity: prefix k is drawn with weight 1 / (k + 1)^this */
    double session_share;       /* share of arrivals that start a multi-turn session; 0..1 */
    uint32_t turns_min;         /* a session has turns_min .. turns_max turns; 2 <= min <= max */
    uint32_t turns_max;
    double think_time_s;        /* mean pause after an answer before the next turn; >= 0 */
    uint32_t new_tokens_min;    /* tokens a turn adds: user message, tool result or question */
    uint32_t new_tokens_max;    /* 1 <= min <= max */
    uint32_t output_tokens_mean; /* answers: exponential around this mean, 1 .. 8x; >= 1 */
    uint32_t max_input_tokens;  /* a session ends before its prompt would pass this (the model's
                                 * context); > common + max(prefix_tokens_max, 512)
                                 * + new_tokens_max */
} km_sim_generator_config;

/* The chat shape's defaults (km_sim_generator_config_shape(KM_SIM_SHAPE_CHAT, cfg)). */
void km_sim_generator_config_init(km_sim_generator_config *cfg);
/* Every field to `shape`'s defaults (docs/SIM.md, "Workloads", lists them), seed 1, 600
 * requests. KM_ERR_NULL_POINTER or KM_ERR_INVALID_ARGUMENT (unknown shape). */
int km_sim_generator_config_shape(km_sim_shape shape, km_sim_generator_config *cfg);

/* Draw a trace. Deterministic: the same config gives the same trace, byte for byte. Requests are
 * in arrival order; n_ids = ceil(input_length / 512), output_length the drawn answer. Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (a field out of range: why says which),
 * KM_ERR_OUT_OF_MEMORY. */
int km_sim_generate_trace(const km_sim_generator_config *cfg, km_trace *out, char *why,
                          size_t why_size);

/* Keep the first max_requests requests (0 = all) and scale arrival times by time_scale (0.5 =
 * twice as fast). Errors: KM_ERR_INVALID_ARGUMENT (time_scale <= 0, or a scaled arrival past
 * KM_TRACE_MAX_TIMESTAMP_MS). */
int km_sim_trace_trim(km_trace *trace, size_t max_requests, double time_scale);

/* What a workload offers a prefix cache, whoever routes it. */
typedef struct km_sim_workload_stats {
    uint64_t requests;
    uint64_t prompt_tokens, output_tokens;
    double prompt_mean, prompt_p50, prompt_p99; /* tokens */
    double output_mean;
    /* Prompt tokens a single engine with unlimited KV cache would reuse: the leading tokens an
     * earlier request's prompt or known answer (answer_tokens, less the last token generated,
     * which is never computed) had already covered, in whole blocks of block_size, never the
     * prompt's last token (vLLM's hit rule). Over prompt_tokens: reusable_share. */
    uint64_t reusable_tokens;
    double reusable_share;
    double span_s;           /* first to last arrival */
    double arrival_rate_per_s; /* km_sim_arrival_rate */
    /* The floor no routing can go below (km_sim_floor_ttft_us), p50 and p99 over the requests an
     * engine admits, in ms; NAN when it admits none. */
    double floor_ttft_p50_ms, floor_ttft_p99_ms;
} km_sim_workload_stats;

/* Requests per second between the 10th and the 90th percentile of arrival times (the run's body,
 * without the sparse ends of its sessions); 0 with fewer than 10 requests or no spread. */
double km_sim_arrival_rate(const km_trace *trace);

/* Each request's floor, in microseconds, into floor_us[i] (trace order): a time to first token no
 * routing and no engine of the model goes below. A request finds cached at the earliest what
 * requests that arrived before it (trace order among equal times) can have computed by then, and
 * computes the rest itself:
 *  - a prompt's tokens exist no earlier than their own prefill could end: from the request's
 *    arrival, or from when the prefix it found exists; a prefill takes at least one step floor and
 *    token_us per token, plus its attention pairs (the engine model);
 *  - a request that finds its prefix still being computed waits for it, and its own tokens then
 *    add at least their time beyond one step floor (they may join the step that completes it);
 *  - an answer's tokens (answer_tokens, never the last one) exist one decode step, a step floor at
 *    least, apart, from the request's first token on;
 *  - a hit is whole blocks of model->block_size and never covers the prompt's last token;
 *  - a request whose prompt and output (output_length, at least 1) need more blocks than
 *    model->capacity_blocks is refused by every engine: it gets no first token and floor_us[i] is
 *    NAN, and it computes nothing another request could find.
 * Queues, other requests' work and memory are left out: each term is a lower bound, so the floor
 * is one, however the requests are routed and scheduled. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_BLOCK_SIZE, KM_ERR_OUT_OF_MEMORY. */
int km_sim_floor_ttft_us(const km_trace *trace, const km_engine_model *model, double *floor_us);

/* Statistics of the first trace->n_requests requests, in blocks of model->block_size, timed by
 * the model. Errors: KM_ERR_NULL_POINTER, KM_ERR_BLOCK_SIZE, KM_ERR_OUT_OF_MEMORY. */
int km_sim_workload_stats_of(const km_trace *trace, const km_engine_model *model,
                             km_sim_workload_stats *out);

#endif
