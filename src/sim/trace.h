/* SPDX-License-Identifier: Apache-2.0 */
/* Workload traces: the Mooncake FAST'25 JSONL format (timestamp ms, input_length, output_length,
 * hash_ids: one id per 512-token block, ids act as chained prefix hashes) and its expansion into
 * this project's chain hashes. An id expands deterministically into tokens_per_id token ids
 * (docs/HASHING.md, "Trace expansion"), so equal ids give equal tokens and equal chain hashes. */
#ifndef KM_TRACE_H
#define KM_TRACE_H

#include <stddef.h>
#include <stdint.h>

typedef struct km_trace_request {
    uint64_t timestamp_ms;
    uint32_t input_length;  /* tokens, at least 1 */
    uint32_t output_length; /* tokens */
    uint32_t n_ids;
    const uint32_t *ids;    /* points into the trace's id pool */
    /* A generated session's turns: 1 + the index in the trace of this turn's previous one (which
     * arrives before it), 0 for a first turn, a single request and every loaded trace's request
     * (the Mooncake format names no sessions). */
    uint32_t previous_turn;
    /* Tokens after input_length that ids cover and this request generates: its answer, as a
     * generated session's next turn would re-send it (<= output_length). 0 when they are not
     * known: every loaded trace's request, and a generated one whose answer would not fit the
     * next prompt. */
    uint32_t answer_tokens;
} km_trace_request;

typedef struct km_trace {
    km_trace_request *requests;
    size_t n_requests;
    uint32_t *id_pool;
    size_t n_ids;
} km_trace;

/* Where the Mooncake conversation trace is: $KM_MOONCAKE_TRACE if set, else
 * ../shared/data/mooncake/conversation_trace.jsonl (relative to the repository root). */
const char *km_trace_default_path(void);

/* The largest timestamp a trace may hold: 2^53 ms (285 000 years), exact as a double, and its
 * microseconds fit a uint64_t clock with room to spare. */
#define KM_TRACE_MAX_TIMESTAMP_MS (UINT64_C(1) << 53)

/* Tokens one id of the Mooncake format stands for: a line's hash_ids cover at most this many
 * tokens each. */
#define KM_TRACE_TOKENS_PER_ID 512u

/* Parse a Mooncake JSONL file (jansson). Bad lines fail the load with a message naming the line:
 * among them a timestamp earlier than the line before's (arrivals are replayed in file order), an
 * empty hash_ids, an input_length of 0 (no prompt) and one past what the ids cover
 * (KM_TRACE_TOKENS_PER_ID each); a file without any request fails too.
 * Returns KM_OK, KM_ERR_IO (missing / unreadable: err says which), KM_ERR_PARSE, KM_ERR_OUT_OF_MEMORY. */
int km_trace_load_mooncake(const char *path, km_trace *out, char *err, size_t err_size);
void km_trace_free(km_trace *trace); /* zeroed or loaded trace; leaves it zeroed */

/* The token ids an id expands into: token j of id = low 32 bits of splitmix64(id * 2^20 + j). */
void km_trace_id_tokens(uint32_t id, uint32_t tokens_per_id, uint32_t *tokens_out);

/* Chain hashes of one request with block_size tokens per block (HASHING.md, no LoRA / salt): the
 * ids expand to tokens, truncated to input_length tokens, and every full block is hashed. out must
 * hold km_trace_max_blocks(r, ...) entries; *n_out gets the count. */
uint32_t km_trace_max_blocks(const km_trace_request *r, uint32_t block_size, uint32_t tokens_per_id);
int km_trace_chain_hashes(const km_trace_request *r, uint32_t block_size, uint32_t tokens_per_id,
                          uint64_t *out, uint32_t *n_out);

#endif
