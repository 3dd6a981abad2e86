/* What the decoder (src/events/kv_events.c) shows the tests beyond its public header. */
#ifndef KM_KV_EVENTS_INTERNAL_H
#define KM_KV_EVENTS_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvmatch/kv_events.h"

/* Whether decoding tries the direct path (the common positional form read in place) before
 * msgpack-c's tree; on by default. Results are the same either way; tests compare the two. */
void km_kv_decoder_set_direct_path(km_kv_decoder *dec, bool on);
/* Whether the direct path may read runs of uint 16 token ids with SSSE3 (on by default where the
 * CPU has it); off, it reads them three to a word. Results are the same either way. */
void km_kv_decoder_set_wide_token_reads(km_kv_decoder *dec, bool on);
/* Payloads the direct path decoded (the rest went through the tree). */
uint64_t km_kv_decoder_direct_decoded(const km_kv_decoder *dec);

#endif
