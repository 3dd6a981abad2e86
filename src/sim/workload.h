/* Internal: workloads for `kvmatch sim` (docs/SIM.md). A workload is a km_trace (src/sim/trace.h):
 * requests of hash ids, one id per 512-token chunk, ids acting as chained prefix names, arrival
 * times in ms. It comes from a Mooncake trace file, or from this generator, which draws a trace
 * with Mooncake-like structure so no file is needed: every request starts with one of a few shared
 * system prompts (popular ones more often), most belong to multi-turn sessions whose every turn
 * extends the previous turn's prompt with its answer and a new user message, the rest are single
 * requests; arrivals are a Poisson process, sessions pause between turns. Token ids come from the
 * ids (km_trace_id_tokens), so equal ids mean equal tokens. */
#ifndef KM_SIM_WORKLOAD_H
#define KM_SIM_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "sim/trace.h"

#define KM_SIM_TOKENS_PER_ID 512u

typedef struct km_sim_generator_config {
    uint64_t seed;
    uint32_t requests;             /* total requests; >= 1 */
    double rate_per_s;             /* mean arrival rate of new sessions and single requests; > 0 */
    uint32_t system_prompts;       /* shared prefixes; >= 1 */
    uint32_t system_prompt_ids_max; /* each is 1 .. this many ids (512 tokens each); >= 1 */
    double session_share;          /* share of arrivals that start a multi-turn session; 0..1 */
    uint32_t turns_max;            /* a session has 2 .. turns_max turns; >= 2 */
    double think_time_s;           /* mean pause between a session's turns; >= 0 */
    uint32_t user_ids_max;         /* a new user message is 1 .. this many ids; >= 1 */
    uint32_t output_tokens_mean;   /* answers: geometric around this mean; >= 1 */
    uint32_t max_input_ids;        /* a prompt is cut to this many ids (the model's context) */
} km_sim_generator_config;

/* Defaults close to the Mooncake conversation trace's shape at a smaller scale: 600 requests at
 * 8/s, 4 system prompts of up to 4 ids, 70% sessions of up to 6 turns with 2 s pauses, user
 * messages of up to 3 ids, 350-token answers, at most 32 ids (16 k tokens) per prompt. */
void km_sim_generator_config_init(km_sim_generator_config *cfg);

/* Draw a trace. Deterministic: the same config gives the same trace, byte for byte. Requests are
 * in arrival order; input_length = ids x 512 (the last id's tokens all count), output_length the
 * drawn answer. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (a field out of range: why
 * says which), KM_ERR_OUT_OF_MEMORY. */
int km_sim_generate_trace(const km_sim_generator_config *cfg, km_trace *out, char *why,
                          size_t why_size);

/* Keep the first max_requests requests (0 = all) and scale arrival times by time_scale (0.5 =
 * twice as fast). Errors: KM_ERR_INVALID_ARGUMENT (time_scale <= 0, or a scaled arrival past
 * KM_TRACE_MAX_TIMESTAMP_MS). */
int km_sim_trace_trim(km_trace *trace, size_t max_requests, double time_scale);

#endif
