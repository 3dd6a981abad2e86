/* SPDX-License-Identifier: Apache-2.0 */
/* The router protocol's vocabulary (include/kvmatch/protocol.h, docs/PROTOCOL.md): default
 * limits, the names of its enums, and the outcome rule. The frame reader, the encoder and the
 * decoder are in protocol_frame_reader.c, protocol_encode.c and protocol_decode.c. */
#include "kvmatch/protocol.h"

/* ---- limits and names ------------------------------------------------------------------------ */

void km_protocol_limits_init(km_protocol_limits *limits)
{
    if (!limits)
        return;
    limits->max_frame_bytes = KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES;
    limits->max_objects = 1u << 22;
    limits->max_batch_items = 4096;
    limits->max_tokens_per_route = 1u << 20;
    limits->max_hashes_per_route = 1u << 16;
    limits->max_candidates = 4096;
    limits->max_params = 64;
    limits->max_string_bytes = 1024;
}

/* Name tables from the header's X-macro lists: [value] = name. */
#define NAME_ENTRY(enumerator, value, name) [value] = name,
static const char *const message_type_names[] = {KM_MESSAGE_TYPE_LIST(NAME_ENTRY)};
static const char *const prediction_source_names[] = {KM_PREDICTION_SOURCE_LIST(NAME_ENTRY)};
static const char *const lifecycle_kind_names[] = {KM_LIFECYCLE_KIND_LIST(NAME_ENTRY)};
static const char *const outcome_names[] = {KM_OUTCOME_LIST(NAME_ENTRY)};
static const char *const admin_action_names[] = {KM_ADMIN_ACTION_LIST(NAME_ENTRY)};
#undef NAME_ENTRY
#define COUNT_OF(table) (sizeof table / sizeof table[0])

/* table[value] when the list names the value, else the name of value 0 (UNKNOWN, NONE). */
static const char *name_in(const char *const *table, size_t count, int value)
{
    return value >= 0 && (size_t)value < count && table[value] ? table[value] : table[0];
}

const char *km_message_type_name(km_message_type type)
{
    return name_in(message_type_names, COUNT_OF(message_type_names), type);
}

const char *km_prediction_source_name(km_prediction_source source)
{
    return name_in(prediction_source_names, COUNT_OF(prediction_source_names), source);
}

const char *km_lifecycle_kind_name(km_lifecycle_kind kind)
{
    return name_in(lifecycle_kind_names, COUNT_OF(lifecycle_kind_names), kind);
}

const char *km_outcome_name(km_outcome outcome)
{
    return name_in(outcome_names, COUNT_OF(outcome_names), outcome);
}

const char *km_admin_action_name(km_admin_action action)
{
    return name_in(admin_action_names, COUNT_OF(admin_action_names), action);
}

km_outcome km_outcome_from_stream(const char *finish_reason, bool done_seen, bool has_http_status,
                                  uint32_t http_status, const char *error)
{
    if ((error && error[0]) || (has_http_status && (http_status < 200 || http_status > 299)))
        return KM_OUTCOME_ERROR;
    if (finish_reason && finish_reason[0] && done_seen)
        return KM_OUTCOME_COMPLETE;
    return KM_OUTCOME_INCOMPLETE;
}
