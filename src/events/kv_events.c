/* SPDX-License-Identifier: Apache-2.0 */
/* KV-event wire decoder (include/kvmatch/kv_events.h, docs/EVENTS.md).
 *
 * A payload goes through three stages, each bounded before the next one spends memory:
 *  1. km_msgpack_scan (src/base/msgpack_scan.h) walks the raw bytes once, with no allocation:
 *     exactly one well-formed value, no container declaring more elements than there are bytes
 *     left, nesting within msgpack-c's stack, at most max_payload_objects values. It also says
 *     exactly how much msgpack-c's zone will need.
 *  2. msgpack_unpack builds the object tree in the handle's zone, which is kept across calls and
 *     grown to the largest payload seen, so steady-state decoding does not allocate. Strings and
 *     bins in the tree point into the caller's payload.
 *  3. decode_batch walks the tree against the event schemas and copies what the caller gets
 *     (arrays, strings) into the handle's arena, also kept across calls.
 * Stage 1 makes stage 2's result predictable; stage 3 never trusts a size it has not checked
 * against a configured limit. Before them, the direct path ("the direct path" below) reads the
 * common positional form in place with msgpuck and hands anything else to the three stages. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>
/* msgpuck's functions are inline; this file emits their one external copy (used nowhere else). */
#define MP_SOURCE 1
#include <msgpuck.h>

#include "kvmatch/kv_events.h"
#include "base/msgpack_scan.h"
#include "events/kv_events_internal.h"

/* x86 builds read runs of uint 16 token ids with SSSE3's byte shuffle when the CPU has it
 * (read_uint16_quads); the build itself targets baseline x86-64. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define KM_TOKENS_SSSE3 1
#include <tmmintrin.h>
#endif

#define LAST_ERROR_BYTES        512
#define REJECT_MESSAGE_BYTES    200
#define UNKNOWN_TYPE_NAME_BYTES 64 /* buffer for the first unknown type name, NUL included */
#define NO_ELEMENT              UINT32_MAX

/* ---- arena: handle-owned storage for decoded results ----------------------------------------- */

/* Blocks form a list, newest first; pointers handed out stay valid until arena_reset. A reset
 * that finds several blocks replaces them with one block of their total size, so after the first
 * few messages a decode fits in a single block and allocates nothing. */
typedef struct arena_block {
    struct arena_block *next;
    size_t capacity;
    size_t used;
    size_t reserved; /* keeps the header a multiple of ARENA_ALIGN */
} arena_block;

#define ARENA_ALIGN     16u
#define ARENA_MIN_BLOCK ((size_t)16 << 10)
_Static_assert(sizeof(arena_block) % ARENA_ALIGN == 0, "arena block header breaks alignment");

typedef struct arena {
    arena_block *blocks;
    size_t capacity_total;
} arena;

static unsigned char *arena_block_data(arena_block *block)
{
    return (unsigned char *)block + sizeof *block;
}

static arena_block *arena_block_new(size_t capacity)
{
    arena_block *block = malloc(sizeof *block + capacity);
    if (block) {
        block->next = NULL;
        block->capacity = capacity;
        block->used = 0;
    }
    return block;
}

static void arena_release(arena *a)
{
    arena_block *block = a->blocks;
    while (block) {
        arena_block *next = block->next;
        free(block);
        block = next;
    }
    a->blocks = NULL;
    a->capacity_total = 0;
}

static void arena_reset(arena *a)
{
    if (a->blocks && a->blocks->next) {
        size_t total = a->capacity_total;
        arena_release(a);
        a->blocks =
            arena_block_new(total); /* failure leaves an empty arena: the next alloc retries */
        if (a->blocks)
            a->capacity_total = total;
    }
    if (a->blocks)
        a->blocks->used = 0;
}

/* Where the arena stands: arena_rewind gives back what was allocated since, and keeps valid what
 * was allocated before (blocks added since stay, empty, for the allocations that follow). */
typedef struct arena_mark {
    arena_block *block;
    size_t used;
} arena_mark;

static arena_mark arena_get_mark(const arena *a)
{
    arena_mark m = {a->blocks, a->blocks ? a->blocks->used : 0};
    return m;
}

static void arena_rewind(arena *a, arena_mark m)
{
    for (arena_block *block = a->blocks; block && block != m.block; block = block->next)
        block->used = 0;
    if (m.block)
        m.block->used = m.used;
}

/* A fresh block for an allocation of `bytes` (already rounded) that the newest block cannot take;
 * NULL when out of memory. */
static void *arena_alloc_new_block(arena *a, size_t bytes)
{
    size_t capacity = a->capacity_total > ARENA_MIN_BLOCK ? a->capacity_total : ARENA_MIN_BLOCK;
    if (capacity < bytes)
        capacity = bytes;
    arena_block *block = arena_block_new(capacity);
    if (!block)
        return NULL;
    block->next = a->blocks;
    a->blocks = block;
    a->capacity_total += capacity;
    block->used = bytes;
    return arena_block_data(block);
}

/* `count` elements of `size` bytes, aligned to ARENA_ALIGN; NULL on overflow or out of memory.
 * A zero-byte request returns a valid, non-dereferenceable-but-non-NULL pointer. Inline, so that
 * each caller's constant size folds the overflow check. */
static inline void *arena_alloc_array(arena *a, size_t count, size_t size)
{
    static _Alignas(16) unsigned char empty_allocation[ARENA_ALIGN];
    if (count == 0 || size == 0)
        return empty_allocation;
    if (count > (SIZE_MAX - ARENA_ALIGN) / size)
        return NULL;
    size_t bytes = (count * size + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    arena_block *block = a->blocks;
    if (!block || block->capacity - block->used < bytes)
        return arena_alloc_new_block(a, bytes);
    void *p = arena_block_data(block) + block->used;
    block->used += bytes;
    return p;
}

/* ---- the handle ------------------------------------------------------------------------------ */

struct km_kv_decoder {
    km_kv_decoder_config config;
    arena results;
    msgpack_zone zone; /* msgpack-c's object tree; chunk_size grows to the largest payload seen */
    bool zone_ready;
    bool zone_overflowed; /* the last unpack needed a second chunk: grow before the next one */
    size_t zone_chunk_bytes;
    bool direct_path; /* try decode_direct first (km_kv_decoder_set_direct_path) */
    bool ssse3;       /* the CPU runs read_uint16_quads */
    uint64_t direct_decoded; /* payloads the direct path decoded */
    km_kv_decoder_stats stats;
    /* Context for error messages while an event is being decoded. */
    uint32_t event_position;
    const char *event_type; /* NULL until the event's type is known */
    char last_error[LAST_ERROR_BYTES];
};

void km_kv_decoder_config_init(km_kv_decoder_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_payload_bytes = (uint64_t)64 << 20;
    cfg->max_payload_objects = 1u << 22;
    cfg->max_events_per_batch = 1u << 16;
    cfg->max_hashes_per_event = 1u << 20;
    cfg->max_tokens_per_event = 1u << 22;
    cfg->max_string_bytes = 1024;
}

int km_kv_decoder_create(const km_kv_decoder_config *cfg, km_kv_decoder **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_kv_decoder_config config;
    if (cfg)
        config = *cfg;
    else
        km_kv_decoder_config_init(&config);
    if (config.max_payload_bytes == 0 || config.max_payload_objects == 0 ||
        config.max_events_per_batch == 0 || config.max_hashes_per_event == 0 ||
        config.max_tokens_per_event == 0 || config.max_string_bytes == 0)
        return KM_ERR_INVALID_ARGUMENT;
    km_kv_decoder *dec = calloc(1, sizeof *dec);
    if (!dec)
        return KM_ERR_OUT_OF_MEMORY;
    dec->config = config;
    dec->direct_path = true;
#ifdef KM_TOKENS_SSSE3
    dec->ssse3 = __builtin_cpu_supports("ssse3");
#endif
    *out = dec;
    return KM_OK;
}

void km_kv_decoder_set_direct_path(km_kv_decoder *dec, bool on)
{
    if (dec)
        dec->direct_path = on;
}

void km_kv_decoder_set_wide_token_reads(km_kv_decoder *dec, bool on)
{
    if (!dec)
        return;
#ifdef KM_TOKENS_SSSE3
    dec->ssse3 = on && __builtin_cpu_supports("ssse3");
#else
    (void)on;
#endif
}

uint64_t km_kv_decoder_direct_decoded(const km_kv_decoder *dec)
{
    return dec ? dec->direct_decoded : 0;
}

void km_kv_decoder_destroy(km_kv_decoder *dec)
{
    if (!dec)
        return;
    arena_release(&dec->results);
    if (dec->zone_ready)
        msgpack_zone_destroy(&dec->zone);
    free(dec);
}

const char *km_kv_decoder_last_error(const km_kv_decoder *dec)
{
    return dec ? dec->last_error : "";
}

int km_kv_decoder_get_stats(const km_kv_decoder *dec, km_kv_decoder_stats *out)
{
    if (!dec || !out)
        return KM_ERR_NULL_POINTER;
    *out = dec->stats;
    out->retained_bytes = (uint64_t)dec->results.capacity_total + dec->zone_chunk_bytes;
    return KM_OK;
}

#define NAME_ENTRY(enumerator, value, name) [value] = name,
static const char *const event_kind_names[] = {KM_KV_EVENT_KIND_LIST(NAME_ENTRY)};
static const char *const medium_names[] = {KM_KV_MEDIUM_LIST(NAME_ENTRY)};
static const char *const rejection_names[] = {KM_KV_REJECTION_LIST(NAME_ENTRY)};
#undef NAME_ENTRY

/* table[value] when the list names the value, else "unknown". */
static const char *name_in(const char *const *table, size_t count, int value)
{
    return value >= 0 && (size_t)value < count && table[value] ? table[value] : "unknown";
}

const char *km_kv_event_kind_name(km_kv_event_kind kind)
{
    return name_in(event_kind_names, sizeof event_kind_names / sizeof *event_kind_names, kind);
}

const char *km_kv_medium_name(km_kv_medium medium)
{
    return name_in(medium_names, sizeof medium_names / sizeof *medium_names, medium);
}

const char *km_kv_rejection_name(km_kv_rejection reason)
{
    return name_in(rejection_names, sizeof rejection_names / sizeof *rejection_names, reason);
}

/* ---- errors ---------------------------------------------------------------------------------- */

#if defined(__GNUC__)
#define KM_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define KM_PRINTF(fmt_index, first_arg)
#endif

static int decoder_vfail(km_kv_decoder *dec, int status, const char *prefix, const char *fmt,
                         va_list ap)
{
    int n = snprintf(dec->last_error, sizeof dec->last_error, "%s: %s", km_error_name(status),
                     prefix ? prefix : "");
    if (n > 0 && (size_t)n < sizeof dec->last_error)
        vsnprintf(dec->last_error + n, sizeof dec->last_error - (size_t)n, fmt, ap);
    return status;
}

KM_PRINTF(3, 4) static int decoder_fail(km_kv_decoder *dec, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    decoder_vfail(dec, status, NULL, fmt, ap);
    va_end(ap);
    return status;
}

/* "event 3 (BlockStored), field token_ids[7]: " + the message. `field` may be NULL, `element`
 * NO_ELEMENT. */
KM_PRINTF(5, 6)
static int event_fail(km_kv_decoder *dec, int status, const char *field, uint32_t element,
                      const char *fmt, ...)
{
    char where[160];
    int n = snprintf(where, sizeof where, "event %u", dec->event_position);
    if (n > 0 && (size_t)n < sizeof where && dec->event_type)
        n += snprintf(where + n, sizeof where - (size_t)n, " (%s)", dec->event_type);
    if (n > 0 && (size_t)n < sizeof where && field) {
        n += snprintf(where + n, sizeof where - (size_t)n, ", field %s", field);
        if (n > 0 && (size_t)n < sizeof where && element != NO_ELEMENT)
            n += snprintf(where + n, sizeof where - (size_t)n, "[%u]", element);
    }
    if (n > 0 && (size_t)n < sizeof where)
        snprintf(where + n, sizeof where - (size_t)n, ": ");
    va_list ap;
    va_start(ap, fmt);
    decoder_vfail(dec, status, where, fmt, ap);
    va_end(ap);
    return status;
}

/* ---- stage 1: bounded pre-scan of the raw bytes ---------------------------------------------- */

_Static_assert(KM_KV_MAX_NESTING_DEPTH <= KM_MSGPACK_SCAN_MAX_DEPTH,
               "the scanner cannot follow the nesting the header promises");

static int prescan_payload(km_kv_decoder *dec, const void *payload, size_t size,
                           km_msgpack_scan_result *shape)
{
    const km_msgpack_limits limits = {
        .max_depth = KM_KV_MAX_NESTING_DEPTH,
        .max_objects = dec->config.max_payload_objects,
        .max_objects_name = "max_payload_objects",
        .value_name = "the batch value (a payload is exactly one msgpack value)",
    };
    int rc = km_msgpack_scan(payload, size, &limits, shape);
    if (rc == KM_OK)
        return KM_OK;
    char why[LAST_ERROR_BYTES];
    km_msgpack_scan_explain(&limits, shape, why, sizeof why);
    return decoder_fail(dec, rc, "%s", why);
}

/* ---- stage 2: msgpack-c's object tree in a reused zone --------------------------------------- */

#define ZONE_MIN_CHUNK ((size_t)16 << 10)
#define ZONE_SLACK     256u

/* Make the zone's first chunk hold `needed` bytes, so msgpack-c never allocates another. */
static int ensure_zone(km_kv_decoder *dec, uint64_t needed)
{
    needed += ZONE_SLACK;
    if (dec->zone_ready && dec->zone_chunk_bytes >= needed && !dec->zone_overflowed)
        return KM_OK;
    /* Double (amortised growth) but never past what the largest allowed payload can need. */
    uint64_t ceiling =
        (uint64_t)dec->config.max_payload_objects * sizeof(msgpack_object) + ZONE_SLACK;
    uint64_t chunk = dec->zone_chunk_bytes ? (uint64_t)dec->zone_chunk_bytes * 2 : ZONE_MIN_CHUNK;
    if (chunk > ceiling)
        chunk = ceiling;
    if (chunk < needed)
        chunk = needed;
    if (dec->zone_ready)
        msgpack_zone_destroy(&dec->zone);
    dec->zone_ready = false;
    dec->zone_overflowed = false;
    dec->zone_chunk_bytes = 0;
    if (!msgpack_zone_init(&dec->zone, (size_t)chunk))
        return decoder_fail(dec, KM_ERR_OUT_OF_MEMORY,
                            "cannot allocate %llu bytes for the msgpack zone",
                            (unsigned long long)chunk);
    dec->zone_ready = true;
    dec->zone_chunk_bytes = (size_t)chunk;
    return KM_OK;
}

/* ---- stage 3: the schema walk ---------------------------------------------------------------- */

typedef enum stored_field {
    STORED_BLOCK_HASHES,
    STORED_PARENT_BLOCK_HASH,
    STORED_TOKEN_IDS,
    STORED_BLOCK_SIZE,
    STORED_LORA_ID,
    STORED_MEDIUM,
    STORED_LORA_NAME,
    STORED_EXTRA_KEYS,
    STORED_GROUP_IDX,
    STORED_KV_CACHE_SPEC_KIND,
    STORED_KV_CACHE_SPEC_SLIDING_WINDOW,
    STORED_POSITIONAL_COUNT, /* fields after this one are read from map events only */
    STORED_LOOKAHEAD_TOKEN_IDS = STORED_POSITIONAL_COUNT, /* vLLM 0.33+ */
    STORED_CACHE_SALT,                                    /* SGLang */
    STORED_FIELD_COUNT
} stored_field;

typedef enum removed_field {
    REMOVED_BLOCK_HASHES,
    REMOVED_MEDIUM,
    REMOVED_GROUP_IDX,
    REMOVED_FIELD_COUNT
} removed_field;

#define MAX_SCHEMA_FIELDS STORED_FIELD_COUNT

/* Field names in positional order (the position after the type name). */
static const char *const stored_field_names[STORED_FIELD_COUNT] = {
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "lookahead_token_ids",
    "cache_salt",
};
static const char *const removed_field_names[REMOVED_FIELD_COUNT] = {"block_hashes", "medium",
                                                                     "group_idx"};

typedef struct event_schema {
    const char *type_name;
    km_kv_event_kind kind;
    const char *const *field_names;
    unsigned n_fields;
    unsigned n_positional; /* fields a positional event carries; later ones are map keys only */
} event_schema;

static const event_schema event_schemas[] = {
    {"BlockStored", KM_KV_EVENT_BLOCK_STORED, stored_field_names, STORED_FIELD_COUNT,
     STORED_POSITIONAL_COUNT},
    {"BlockRemoved", KM_KV_EVENT_BLOCK_REMOVED, removed_field_names, REMOVED_FIELD_COUNT,
     REMOVED_FIELD_COUNT},
    {"AllBlocksCleared", KM_KV_EVENT_ALL_BLOCKS_CLEARED, NULL, 0, 0},
};

static bool str_equals(const msgpack_object *o, const char *s)
{
    size_t n = strlen(s);
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n &&
           memcmp(o->via.str.ptr, s, n) == 0;
}

static bool ascii_case_equals(const char *a, size_t a_len, const char *b)
{
    size_t b_len = strlen(b);
    if (a_len != b_len)
        return false;
    for (size_t i = 0; i < a_len; i++) {
        char x = a[i], y = b[i];
        if (x >= 'a' && x <= 'z')
            x = (char)(x - 'a' + 'A');
        if (y >= 'a' && y <= 'z')
            y = (char)(y - 'a' + 'A');
        if (x != y)
            return false;
    }
    return true;
}

/* The decode of one batch: where valid and rejected events go. */
typedef struct batch_builder {
    km_kv_event *events;
    km_kv_rejected_event *rejected;
    km_kv_batch *batch;
} batch_builder;

static int out_of_memory(km_kv_decoder *dec, const char *what)
{
    return decoder_fail(dec, KM_ERR_OUT_OF_MEMORY, "cannot allocate memory for %s", what);
}

/* Copy a string into the arena, NUL-terminated. */
static const char *arena_copy_string(km_kv_decoder *dec, const char *s, size_t n)
{
    char *copy = arena_alloc_array(&dec->results, n + 1, 1);
    if (copy) {
        if (n)
            memcpy(copy, s, n);
        copy[n] = 0;
    }
    return copy;
}

/* An engine block hash -> u64 id (rule in kv_events.h). */
static int read_hash(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                     uint32_t element, uint64_t *out)
{
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = o->via.u64; return KM_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (uint64_t)o->via.i64; return KM_OK;
    case MSGPACK_OBJECT_BIN: {
        uint32_t n = o->via.bin.size;
        if (n < 1 || n > KM_KV_MAX_BYTES_HASH)
            return event_fail(dec, KM_ERR_PARSE, field, element,
                              "a bytes hash must be 1..%u bytes long, got %u", KM_KV_MAX_BYTES_HASH,
                              n);
        unsigned take = n < 8 ? n : 8;
        *out = km_read_be((const uint8_t *)o->via.bin.ptr + (n - take), take);
        return KM_OK;
    }
    default:
        return event_fail(dec, KM_ERR_PARSE, field, element,
                          "expected a block hash (int or bytes), got %s", km_msgpack_type_name(o));
    }
}

static int read_hash_array(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                           const uint64_t **out, uint32_t *n_out)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT,
                          "expected an array of block hashes, got %s", km_msgpack_type_name(o));
    uint32_t n = o->via.array.size;
    if (n > dec->config.max_hashes_per_event)
        return event_fail(dec, KM_ERR_TOO_LARGE, field, NO_ELEMENT,
                          "%u hashes, limit max_hashes_per_event = %u", n,
                          dec->config.max_hashes_per_event);
    uint64_t *hashes = arena_alloc_array(&dec->results, n, sizeof *hashes);
    if (!hashes)
        return out_of_memory(dec, "block hashes");
    for (uint32_t i = 0; i < n; i++) {
        int rc = read_hash(dec, &o->via.array.ptr[i], field, i, &hashes[i]);
        if (rc != KM_OK)
            return rc;
    }
    *out = hashes;
    *n_out = n;
    return KM_OK;
}

/* The name errors give a token array: `field`, or "field[list]" for one list of a field that holds
 * several (list not NO_ELEMENT), written into buf. */
static const char *token_array_name(char *buf, size_t size, const char *field, uint32_t list)
{
    if (list == NO_ELEMENT)
        return field;
    snprintf(buf, size, "%s[%u]", field, list);
    return buf;
}

/* An array of token ids; `list` is its index in a field holding one such array per block
 * (lookahead_token_ids), NO_ELEMENT for token_ids itself. */
static int read_token_array(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                            uint32_t list, const uint32_t **out, uint32_t *n_out)
{
    char name[64];
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return event_fail(dec, KM_ERR_PARSE, token_array_name(name, sizeof name, field, list),
                          NO_ELEMENT, "expected an array of token ids, got %s",
                          km_msgpack_type_name(o));
    uint32_t n = o->via.array.size;
    if (n > dec->config.max_tokens_per_event)
        return event_fail(dec, KM_ERR_TOO_LARGE, token_array_name(name, sizeof name, field, list),
                          NO_ELEMENT, "%u tokens, limit max_tokens_per_event = %u", n,
                          dec->config.max_tokens_per_event);
    uint32_t *tokens = arena_alloc_array(&dec->results, n, sizeof *tokens);
    if (!tokens)
        return out_of_memory(dec, "token ids");
    const msgpack_object *items = o->via.array.ptr;
    for (uint32_t i = 0; i < n; i++) {
        if (items[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER || items[i].via.u64 > UINT32_MAX) {
            const char *where = token_array_name(name, sizeof name, field, list);
            if (items[i].type == MSGPACK_OBJECT_POSITIVE_INTEGER ||
                items[i].type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
                return event_fail(dec, KM_ERR_PARSE, where, i, "token id out of range 0..2^32-1");
            return event_fail(dec, KM_ERR_PARSE, where, i, "expected an int in 0..2^32-1, got %s",
                              km_msgpack_type_name(&items[i]));
        }
        tokens[i] = (uint32_t)items[i].via.u64;
    }
    *out = tokens;
    *n_out = n;
    return KM_OK;
}

/* int|nil (absent = nil) as int64. */
static int read_optional_i64(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                             bool *has, int64_t *out)
{
    *has = false;
    *out = 0;
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return KM_OK;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ||
        (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX)) {
        *has = true;
        *out = o->via.i64;
        return KM_OK;
    }
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT, "value above 2^63-1");
    return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT, "expected an int or nil, got %s",
                      km_msgpack_type_name(o));
}

/* int|nil (absent = nil) in 0..2^32-1. */
static int read_optional_u32(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                             bool *has, uint32_t *out)
{
    *has = false;
    *out = 0;
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return KM_OK;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= UINT32_MAX) {
        *has = true;
        *out = (uint32_t)o->via.u64;
        return KM_OK;
    }
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER || o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT, "value out of range 0..2^32-1");
    return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT, "expected an int or nil, got %s",
                      km_msgpack_type_name(o));
}

/* str|nil (absent = nil), copied; *out NULL for nil. *has_nul reports an embedded NUL byte. */
static int read_optional_string(km_kv_decoder *dec, const msgpack_object *o, const char *field,
                                const char **out, bool *has_nul)
{
    *out = NULL;
    *has_nul = false;
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return KM_OK;
    if (o->type != MSGPACK_OBJECT_STR)
        return event_fail(dec, KM_ERR_PARSE, field, NO_ELEMENT, "expected a str or nil, got %s",
                          km_msgpack_type_name(o));
    uint32_t n = o->via.str.size;
    if (n > dec->config.max_string_bytes)
        return event_fail(dec, KM_ERR_TOO_LARGE, field, NO_ELEMENT,
                          "%u bytes, limit max_string_bytes = %u", n, dec->config.max_string_bytes);
    *has_nul = n > 0 && memchr(o->via.str.ptr, 0, n) != NULL;
    *out = arena_copy_string(dec, o->via.str.ptr, n);
    return *out ? KM_OK : out_of_memory(dec, field);
}

/* Does a BlockStored's extra_keys entry hold only keys kvmatch's hashing reproduces? vLLM builds
 * each entry as lora keys + multimodal keys + cache salt (first block of a request only) + prompt-
 * embedding digests (generate_block_hash_extra_keys). Known: a first element naming the event's
 * adapter (lora_name, or the deprecated int lora_id), and, when first_block (position 0), one
 * string after it: the salt (*salt set). Anything else is opaque: arrays (multimodal (identifier,
 * offset) pairs), bytes (prompt embeddings), more strings (older engines' multimodal hashes), other
 * types, a salt with a NUL byte or over max_string_bytes. A lone multimodal hash string of an older
 * engine in block 0 passes for a salt: the chain is then hashed under a salt no router request
 * carries, a miss, never a false match. */
static bool extra_keys_entry_known(const km_kv_event *ev, const msgpack_object *entry,
                                   bool first_block, uint32_t max_string_bytes,
                                   const msgpack_object **salt)
{
    *salt = NULL;
    if (entry->type == MSGPACK_OBJECT_NIL)
        return true;
    if (entry->type != MSGPACK_OBJECT_ARRAY)
        return false;
    uint32_t n = entry->via.array.size, i = 0;
    const msgpack_object *items = entry->via.array.ptr;
    if (n > 0 && ev->lora_name && ev->lora_name[0] && str_equals(&items[0], ev->lora_name))
        i = 1;
    else if (n > 0 && ev->has_lora_id && items[0].type == MSGPACK_OBJECT_POSITIVE_INTEGER &&
             ev->lora_id >= 0 && items[0].via.u64 == (uint64_t)ev->lora_id)
        i = 1;
    if (i == n)
        return true;
    if (!first_block || n - i != 1 || items[i].type != MSGPACK_OBJECT_STR)
        return false;
    uint32_t len = items[i].via.str.size;
    if (len == 0 || len > max_string_bytes || memchr(items[i].via.str.ptr, 0, len))
        return false;
    *salt = &items[i];
    return true;
}

/* The medium strings the engines and their KV connectors publish (docs/EVENTS.md, "Media"). */
static const struct {
    const char *name;
    km_kv_medium medium;
} known_media[] = {
    {"GPU", KM_KV_MEDIUM_GPU},            /* vLLM, SGLang */
    {"CUDA", KM_KV_MEDIUM_GPU},           /* LMCache: a torch device name */
    {"CPU", KM_KV_MEDIUM_CPU},            /* vLLM and its offloading connectors, LMCache, Mooncake */
    {"CPU_PINNED", KM_KV_MEDIUM_CPU},     /* SGLang's host tier (L2) */
    {"DISK", KM_KV_MEDIUM_DISK},          /* SGLang (L3) */
    {"STORAGE", KM_KV_MEDIUM_DISK},       /* vLLM's offloading connector, storage tier */
    {"EXTERNAL", KM_KV_MEDIUM_EXTERNAL},  /* SGLang's shared or remote pool (L4) */
};

/* Any letter case; "cuda:<n>" (a torch device with its index) is the GPU. */
static km_kv_medium medium_of_name(const char *name, size_t n)
{
    for (size_t i = 0; i < sizeof known_media / sizeof known_media[0]; i++)
        if (ascii_case_equals(name, n, known_media[i].name))
            return known_media[i].medium;
    if (n > 5 && ascii_case_equals(name, 5, "CUDA:")) {
        size_t i = 5;
        while (i < n && name[i] >= '0' && name[i] <= '9')
            i++;
        if (i == n)
            return KM_KV_MEDIUM_GPU;
    }
    return KM_KV_MEDIUM_OTHER;
}

/* lookahead_token_ids: nil, or one list of token ids per block, all of one length L >= 1 (the
 * engine's num_hash_lookahead_tokens). Delivered flat, block by block. A list count or length
 * that does not fit is reported through *inconsistent (the event is rejected, not the message). */
static int read_lookahead(km_kv_decoder *dec, const msgpack_object *o, uint32_t n_blocks,
                          km_kv_event *ev, char *inconsistent, size_t inconsistent_size)
{
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return KM_OK;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return event_fail(dec, KM_ERR_PARSE, "lookahead_token_ids", NO_ELEMENT,
                          "expected an array (one list per block) or nil, got %s",
                          km_msgpack_type_name(o));
    uint32_t n = o->via.array.size;
    const msgpack_object *lists = o->via.array.ptr;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (lists[i].type != MSGPACK_OBJECT_ARRAY)
            return event_fail(dec, KM_ERR_PARSE, "lookahead_token_ids", i,
                              "expected an array of token ids, got %s",
                              km_msgpack_type_name(&lists[i]));
        total += lists[i].via.array.size;
    }
    if (total > dec->config.max_tokens_per_event)
        return event_fail(dec, KM_ERR_TOO_LARGE, "lookahead_token_ids", NO_ELEMENT,
                          "%llu tokens, limit max_tokens_per_event = %u",
                          (unsigned long long)total, dec->config.max_tokens_per_event);
    uint32_t per_block = n ? lists[0].via.array.size : 0;
    uint32_t *tokens = arena_alloc_array(&dec->results, total ? total : 1, sizeof *tokens);
    if (!tokens)
        return out_of_memory(dec, "lookahead token ids");
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t *list;
        uint32_t len;
        int rc = read_token_array(dec, &lists[i], "lookahead_token_ids", i, &list, &len);
        if (rc != KM_OK)
            return rc;
        if (len)
            memcpy(tokens + at, list, (size_t)len * sizeof *list);
        at += len;
        if (len != per_block && !inconsistent[0])
            snprintf(inconsistent, inconsistent_size,
                     "lookahead_token_ids[%u] has %u tokens, block 0's has %u", i, len, per_block);
    }
    if (!inconsistent[0] && n != n_blocks)
        snprintf(inconsistent, inconsistent_size,
                 "lookahead_token_ids has %u lists for %u blocks", n, n_blocks);
    if (!inconsistent[0] && n && per_block == 0)
        snprintf(inconsistent, inconsistent_size, "lookahead_token_ids lists are empty");
    ev->lookahead_token_ids = tokens;
    ev->n_lookahead_tokens = per_block;
    return KM_OK;
}

static int read_medium(km_kv_decoder *dec, const msgpack_object *o, km_kv_medium *medium,
                       const char **name, bool *has_nul)
{
    int rc = read_optional_string(dec, o, "medium", name, has_nul);
    if (rc != KM_OK)
        return rc;
    *medium = KM_KV_MEDIUM_GPU;
    if (*name)
        *medium = medium_of_name(*name, o->via.str.size);
    return KM_OK;
}

/* Report the current event as rejected: it stays out of batch.events. */
KM_PRINTF(6, 7)
static int reject_event(km_kv_decoder *dec, batch_builder *b, km_kv_event_kind kind,
                        km_kv_rejection reason, int status, const char *fmt, ...)
{
    char message[REJECT_MESSAGE_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    km_kv_rejected_event *r = &b->rejected[b->batch->n_rejected];
    r->position = dec->event_position;
    r->kind = kind;
    r->reason = reason;
    r->status = status;
    r->message = arena_copy_string(dec, message, strlen(message));
    if (!r->message)
        return out_of_memory(dec, "a rejected event's message");
    b->batch->n_rejected++;
    return KM_OK;
}

/* Collect an event's fields by schema position. Positional: element i + 1; missing trailing
 * elements stay NULL (= default), extra ones are ignored. Map: by key; unknown keys and non-str
 * keys are ignored, a repeated known key is an error. */
static int gather_fields(km_kv_decoder *dec, const msgpack_object *event,
                         const event_schema *schema, const msgpack_object **fields)
{
    for (unsigned f = 0; f < schema->n_fields; f++)
        fields[f] = NULL;
    if (event->type == MSGPACK_OBJECT_ARRAY) {
        uint32_t n = event->via.array.size;
        for (unsigned f = 0; f < schema->n_positional && f + 1 < n; f++)
            fields[f] = &event->via.array.ptr[f + 1];
        return KM_OK;
    }
    const msgpack_object_kv *kv = event->via.map.ptr;
    for (uint32_t i = 0; i < event->via.map.size; i++) {
        for (unsigned f = 0; f < schema->n_fields; f++) {
            if (!str_equals(&kv[i].key, schema->field_names[f]))
                continue;
            if (fields[f])
                return event_fail(dec, KM_ERR_PARSE, schema->field_names[f], NO_ELEMENT,
                                  "key appears twice in the event map");
            fields[f] = &kv[i].val;
            break;
        }
    }
    return KM_OK;
}

static int require_field(km_kv_decoder *dec, const msgpack_object *const *fields,
                         const event_schema *schema, unsigned f)
{
    if (fields[f])
        return KM_OK;
    return event_fail(dec, KM_ERR_PARSE, schema->field_names[f], NO_ELEMENT,
                      "required field missing");
}

static int decode_block_stored(km_kv_decoder *dec, const event_schema *schema,
                               const msgpack_object *const *fields, batch_builder *b)
{
    int rc;
    for (unsigned f = STORED_BLOCK_HASHES; f <= STORED_BLOCK_SIZE; f++)
        if (f != STORED_PARENT_BLOCK_HASH && (rc = require_field(dec, fields, schema, f)) != KM_OK)
            return rc;
    km_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KM_KV_EVENT_BLOCK_STORED;
    ev.position = dec->event_position;
    if ((rc = read_hash_array(dec, fields[STORED_BLOCK_HASHES], "block_hashes", &ev.block_hashes,
                              &ev.n_block_hashes)) != KM_OK)
        return rc;
    const msgpack_object *parent = fields[STORED_PARENT_BLOCK_HASH];
    if (parent && parent->type != MSGPACK_OBJECT_NIL) {
        if ((rc = read_hash(dec, parent, "parent_block_hash", NO_ELEMENT, &ev.parent_block_hash)) !=
            KM_OK)
            return rc;
        ev.has_parent_block_hash = true;
    }
    if ((rc = read_token_array(dec, fields[STORED_TOKEN_IDS], "token_ids", NO_ELEMENT,
                               &ev.token_ids, &ev.n_token_ids)) != KM_OK)
        return rc;
    const msgpack_object *block_size = fields[STORED_BLOCK_SIZE];
    if (block_size->type != MSGPACK_OBJECT_POSITIVE_INTEGER &&
        block_size->type != MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return event_fail(dec, KM_ERR_PARSE, "block_size", NO_ELEMENT, "expected an int, got %s",
                          km_msgpack_type_name(block_size));
    if ((rc = read_optional_i64(dec, fields[STORED_LORA_ID], "lora_id", &ev.has_lora_id,
                                &ev.lora_id)) != KM_OK)
        return rc;
    bool medium_nul, lora_nul, kind_nul;
    if ((rc = read_medium(dec, fields[STORED_MEDIUM], &ev.medium, &ev.medium_name, &medium_nul)) !=
        KM_OK)
        return rc;
    if ((rc = read_optional_string(dec, fields[STORED_LORA_NAME], "lora_name", &ev.lora_name,
                                   &lora_nul)) != KM_OK)
        return rc;
    const msgpack_object *extra = fields[STORED_EXTRA_KEYS];
    if (extra && extra->type != MSGPACK_OBJECT_NIL && extra->type != MSGPACK_OBJECT_ARRAY)
        return event_fail(dec, KM_ERR_PARSE, "extra_keys", NO_ELEMENT,
                          "expected an array (one entry per block) or nil, got %s",
                          km_msgpack_type_name(extra));
    if ((rc = read_optional_u32(dec, fields[STORED_GROUP_IDX], "group_idx", &ev.has_group_idx,
                                &ev.group_idx)) != KM_OK)
        return rc;
    if ((rc = read_optional_string(dec, fields[STORED_KV_CACHE_SPEC_KIND], "kv_cache_spec_kind",
                                   &ev.kv_cache_spec_kind, &kind_nul)) != KM_OK)
        return rc;
    if ((rc = read_optional_i64(
             dec, fields[STORED_KV_CACHE_SPEC_SLIDING_WINDOW], "kv_cache_spec_sliding_window",
             &ev.has_kv_cache_spec_sliding_window, &ev.kv_cache_spec_sliding_window)) != KM_OK)
        return rc;
    bool salt_nul;
    char lookahead_problem[REJECT_MESSAGE_BYTES] = "";
    if ((rc = read_lookahead(dec, fields[STORED_LOOKAHEAD_TOKEN_IDS], ev.n_block_hashes, &ev,
                             lookahead_problem, sizeof lookahead_problem)) != KM_OK)
        return rc;
    const char *top_salt = NULL;
    if ((rc = read_optional_string(dec, fields[STORED_CACHE_SALT], "cache_salt", &top_salt,
                                   &salt_nul)) != KM_OK)
        return rc;

    /* Every field is well-typed; what follows are consistency checks that reject only this
     * event. */
    if (block_size->type == MSGPACK_OBJECT_POSITIVE_INTEGER && block_size->via.u64 == 0 &&
        ev.n_token_ids == 0 && !ev.has_parent_block_hash && ev.n_lookahead_tokens == 0) {
        if (ev.medium == KM_KV_MEDIUM_GPU)
            return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_BLOCK_SIZE,
                                KM_ERR_BLOCK_SIZE,
                                "block_size 0 is below 1 (a placeholder store, without token_ids "
                                "or parent, names a medium other than the GPU)");
        ev.placeholder = true;
    }
    if (!ev.placeholder &&
        (block_size->type == MSGPACK_OBJECT_NEGATIVE_INTEGER || block_size->via.u64 < 1))
        return reject_event(
            dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_BLOCK_SIZE, KM_ERR_BLOCK_SIZE,
            "block_size %lld is below 1",
            block_size->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? (long long)block_size->via.i64
                                                                : 0LL);
    if (block_size->via.u64 > UINT32_MAX)
        return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_BLOCK_SIZE,
                            KM_ERR_BLOCK_SIZE, "block_size %llu is above 2^32-1",
                            (unsigned long long)block_size->via.u64);
    ev.block_size = (uint32_t)block_size->via.u64;
    uint64_t expected_tokens = (uint64_t)ev.block_size * ev.n_block_hashes;
    ev.sparse_blocks = !ev.placeholder && ev.has_group_idx && ev.n_block_hashes > 0 &&
                       ev.n_token_ids > expected_tokens && ev.n_token_ids % ev.block_size == 0;
    if (ev.n_token_ids != expected_tokens && !ev.sparse_blocks)
        return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_TOKEN_COUNT,
                            KM_ERR_PARSE, "token_ids has %u tokens, block_size %u x %u block_hashes needs %llu",
                            ev.n_token_ids, ev.block_size, ev.n_block_hashes,
                            (unsigned long long)expected_tokens);
    if (lookahead_problem[0])
        return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_TOKEN_COUNT,
                            KM_ERR_PARSE, "%s", lookahead_problem);
    if (lora_nul || medium_nul || kind_nul || salt_nul)
        return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_NUL_BYTE,
                            KM_ERR_PARSE, "%s contains a NUL byte",
                            lora_nul     ? "lora_name"
                            : medium_nul ? "medium"
                            : kind_nul   ? "kv_cache_spec_kind"
                                         : "cache_salt");
    if (extra && extra->type == MSGPACK_OBJECT_ARRAY) {
        if (extra->via.array.size != ev.n_block_hashes)
            return reject_event(dec, b, KM_KV_EVENT_BLOCK_STORED, KM_KV_REJECTED_EXTRA_KEYS,
                                KM_ERR_PARSE, "extra_keys has %u entries for %u blocks", extra->via.array.size,
                                ev.n_block_hashes);
        uint8_t *present = arena_alloc_array(&dec->results, ev.n_block_hashes, 1);
        uint8_t *opaque = arena_alloc_array(&dec->results, ev.n_block_hashes, 1);
        if (!present || !opaque)
            return out_of_memory(dec, "extra_keys flags");
        for (uint32_t i = 0; i < ev.n_block_hashes; i++) {
            const msgpack_object *entry = &extra->via.array.ptr[i];
            present[i] = !(entry->type == MSGPACK_OBJECT_NIL ||
                           (entry->type == MSGPACK_OBJECT_ARRAY && entry->via.array.size == 0));
            const msgpack_object *salt = NULL;
            opaque[i] = present[i] &&
                        !extra_keys_entry_known(&ev, entry, i == 0 && !ev.has_parent_block_hash,
                                                dec->config.max_string_bytes, &salt);
            if (salt) {
                ev.cache_salt = arena_copy_string(dec, salt->via.str.ptr, salt->via.str.size);
                if (!ev.cache_salt)
                    return out_of_memory(dec, "cache salt");
            }
        }
        ev.extra_keys_present = present;
        ev.extra_keys_opaque = opaque;
    }
    /* SGLang names the salt of the request that stored the blocks in a field of its own, on
     * every event of the request: it counts where the salt counts, on a run that starts a
     * sequence (docs/HASHING.md). It wins over a salt read from extra_keys. */
    if (top_salt && top_salt[0] && !ev.has_parent_block_hash)
        ev.cache_salt = top_salt;
    b->events[b->batch->n_events++] = ev;
    return KM_OK;
}

static int decode_block_removed(km_kv_decoder *dec, const event_schema *schema,
                                const msgpack_object *const *fields, batch_builder *b)
{
    int rc = require_field(dec, fields, schema, REMOVED_BLOCK_HASHES);
    if (rc != KM_OK)
        return rc;
    km_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KM_KV_EVENT_BLOCK_REMOVED;
    ev.position = dec->event_position;
    if ((rc = read_hash_array(dec, fields[REMOVED_BLOCK_HASHES], "block_hashes", &ev.block_hashes,
                              &ev.n_block_hashes)) != KM_OK)
        return rc;
    bool medium_nul;
    if ((rc = read_medium(dec, fields[REMOVED_MEDIUM], &ev.medium, &ev.medium_name, &medium_nul)) !=
        KM_OK)
        return rc;
    if ((rc = read_optional_u32(dec, fields[REMOVED_GROUP_IDX], "group_idx", &ev.has_group_idx,
                                &ev.group_idx)) != KM_OK)
        return rc;
    if (medium_nul)
        return reject_event(dec, b, KM_KV_EVENT_BLOCK_REMOVED, KM_KV_REJECTED_NUL_BYTE,
                            KM_ERR_PARSE, "medium contains a NUL byte");
    b->events[b->batch->n_events++] = ev;
    return KM_OK;
}

/* The event's type name: element 0 of a positional event, the "type" entry of a map event. */
static int find_event_type(km_kv_decoder *dec, const msgpack_object *event,
                           const msgpack_object **type)
{
    *type = NULL;
    if (event->type == MSGPACK_OBJECT_ARRAY) {
        if (event->via.array.size == 0)
            return event_fail(dec, KM_ERR_PARSE, NULL, NO_ELEMENT,
                              "empty array (a positional event starts with its type name)");
        *type = &event->via.array.ptr[0];
    } else if (event->type == MSGPACK_OBJECT_MAP) {
        const msgpack_object_kv *kv = event->via.map.ptr;
        for (uint32_t i = 0; i < event->via.map.size; i++) {
            if (!str_equals(&kv[i].key, "type"))
                continue;
            if (*type)
                return event_fail(dec, KM_ERR_PARSE, "type", NO_ELEMENT,
                                  "key appears twice in the event map");
            *type = &kv[i].val;
        }
        if (!*type)
            return event_fail(dec, KM_ERR_PARSE, NULL, NO_ELEMENT, "event map has no \"type\" key");
    } else {
        return event_fail(dec, KM_ERR_PARSE, NULL, NO_ELEMENT,
                          "expected an event (array or map), got %s", km_msgpack_type_name(event));
    }
    if ((*type)->type != MSGPACK_OBJECT_STR)
        return event_fail(dec, KM_ERR_PARSE, "type", NO_ELEMENT,
                          "expected the type name as str, got %s", km_msgpack_type_name(*type));
    return KM_OK;
}

static int decode_event(km_kv_decoder *dec, const msgpack_object *event, batch_builder *b)
{
    dec->event_type = NULL;
    const msgpack_object *type;
    int rc = find_event_type(dec, event, &type);
    if (rc != KM_OK)
        return rc;
    const event_schema *schema = NULL;
    for (size_t i = 0; i < sizeof event_schemas / sizeof event_schemas[0]; i++)
        if (str_equals(type, event_schemas[i].type_name))
            schema = &event_schemas[i];
    if (!schema) {
        km_kv_batch *batch = b->batch;
        if (batch->n_unknown_events++ == 0) {
            uint32_t n = type->via.str.size;
            if (n > UNKNOWN_TYPE_NAME_BYTES - 1)
                n = UNKNOWN_TYPE_NAME_BYTES - 1;
            char *name = (char *)arena_copy_string(dec, type->via.str.ptr, n);
            if (!name)
                return out_of_memory(dec, "the unknown type name");
            for (uint32_t i = 0; i < n; i++) /* it goes to logs: no NUL, no control bytes */
                if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
                    name[i] = '?';
            batch->first_unknown_type = name;
        }
        return KM_OK;
    }
    dec->event_type = schema->type_name;
    const msgpack_object *fields[MAX_SCHEMA_FIELDS];
    if ((rc = gather_fields(dec, event, schema, fields)) != KM_OK)
        return rc;
    switch (schema->kind) {
    case KM_KV_EVENT_BLOCK_STORED: return decode_block_stored(dec, schema, fields, b);
    case KM_KV_EVENT_BLOCK_REMOVED: return decode_block_removed(dec, schema, fields, b);
    case KM_KV_EVENT_ALL_BLOCKS_CLEARED: {
        km_kv_event *ev = &b->events[b->batch->n_events++];
        memset(ev, 0, sizeof *ev);
        ev->kind = KM_KV_EVENT_ALL_BLOCKS_CLEARED;
        ev->position = dec->event_position;
        return KM_OK;
    }
    }
    return decoder_fail(dec, KM_ERR_INTERNAL, "event schema without a decoder");
}

/* [ts, events, data_parallel_rank]; the rank may be absent, extra trailing elements are ignored. */
static int decode_batch(km_kv_decoder *dec, const msgpack_object *root, km_kv_batch *out)
{
    if (root->type != MSGPACK_OBJECT_ARRAY)
        return decoder_fail(
            dec, KM_ERR_PARSE,
            "payload: expected the batch array [ts, events, data_parallel_rank], got %s",
            km_msgpack_type_name(root));
    const msgpack_object *items = root->via.array.ptr;
    if (root->via.array.size < 2)
        return decoder_fail(dec, KM_ERR_PARSE,
                            "batch array has %u elements, at least 2 needed (ts, events)",
                            root->via.array.size);
    const msgpack_object *ts = &items[0];
    switch (ts->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: out->timestamp = ts->via.f64; break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: out->timestamp = (double)ts->via.u64; break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: out->timestamp = (double)ts->via.i64; break;
    default:
        return decoder_fail(dec, KM_ERR_PARSE, "batch ts: expected a float or int, got %s",
                            km_msgpack_type_name(ts));
    }
    if (root->via.array.size >= 3) {
        const msgpack_object *rank = &items[2];
        if (rank->type == MSGPACK_OBJECT_POSITIVE_INTEGER && rank->via.u64 <= UINT32_MAX) {
            out->has_data_parallel_rank = true;
            out->data_parallel_rank = (uint32_t)rank->via.u64;
        } else if (rank->type == MSGPACK_OBJECT_POSITIVE_INTEGER ||
                   rank->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            return decoder_fail(dec, KM_ERR_PARSE,
                                "batch data_parallel_rank: out of range 0..2^32-1");
        } else if (rank->type != MSGPACK_OBJECT_NIL) {
            return decoder_fail(dec, KM_ERR_PARSE,
                                "batch data_parallel_rank: expected an int or nil, got %s",
                                km_msgpack_type_name(rank));
        }
    }
    const msgpack_object *events = &items[1];
    if (events->type != MSGPACK_OBJECT_ARRAY)
        return decoder_fail(dec, KM_ERR_PARSE, "batch events: expected an array, got %s",
                            km_msgpack_type_name(events));
    uint32_t n = events->via.array.size;
    if (n > dec->config.max_events_per_batch)
        return decoder_fail(dec, KM_ERR_TOO_LARGE,
                            "batch has %u events, limit max_events_per_batch = %u", n,
                            dec->config.max_events_per_batch);
    batch_builder b = {
        .events = arena_alloc_array(&dec->results, n, sizeof(km_kv_event)),
        .rejected = arena_alloc_array(&dec->results, n, sizeof(km_kv_rejected_event)),
        .batch = out,
    };
    if (!b.events || !b.rejected)
        return out_of_memory(dec, "the event array");
    for (uint32_t i = 0; i < n; i++) {
        dec->event_position = i;
        int rc = decode_event(dec, &events->via.array.ptr[i], &b);
        if (rc != KM_OK)
            return rc;
    }
    out->events = b.events;
    out->rejected = b.rejected;
    out->n_payload_events = n;
    return KM_OK;
}

/* ---- the direct path: the common positional form, read in place ------------------------------ */

/* Engines publish one small message per scheduler step, nearly always in one shape: a positional
 * batch of positional BlockStored / BlockRemoved / AllBlocksCleared events whose optional fields
 * are nil. For such a payload, building msgpack-c's tree and walking it costs more than the
 * events themselves, so decode_payload_into first reads it in place with msgpuck's cursor
 * functions, every read checked against the end of the payload. The direct path takes only what
 * it can decode exactly as the tree path would (same km_kv_batch, same arena contents); anything
 * else (a map event, a bytes hash, a string field other than the medium, a limit reached, an
 * event the tree path would reject or refuse, trailing bytes) makes it decline, and the payload
 * goes through the three stages above from the start. tests/test_kv_events.c decodes random
 * payloads both ways and compares. */

#define DIRECT_DECLINED 1 /* not an error: the tree path decodes the payload */

/* Every msgpack value takes a byte at least, so a payload of at most max_payload_objects bytes
 * holds no more values than the limit allows: the direct path takes only such payloads
 * (decode_direct) and counts nothing; a larger one goes to the tree path, which counts. */
typedef struct direct_cursor {
    const char *p, *end;
} direct_cursor;

/* The next value's type; false at the end of the payload. */
static bool direct_peek(const direct_cursor *c, enum mp_type *type)
{
    if (c->p >= c->end)
        return false;
    *type = mp_typeof(*c->p);
    return true;
}

/* direct_array and direct_int are forced inline: read at every event several times, they then
 * keep the cursor in registers. */
__attribute__((always_inline)) static inline bool direct_array(direct_cursor *c, uint32_t *n)
{
    if (c->p >= c->end)
        return false;
    uint8_t first = (uint8_t)*c->p;
    /* A fixarray or an array 16 (batches, events, hash and token arrays) is told from its first
     * byte without msgpuck's type dispatch. */
    if ((first & 0xf0) == 0x90) {
        c->p++;
        *n = first & 0x0f;
    } else if (first == 0xdc && c->end - c->p >= 3) {
        c->p++;
        *n = mp_load_u16(&c->p);
    } else if (mp_typeof(*c->p) == MP_ARRAY && mp_check_array(c->p, c->end) <= 0) {
        *n = mp_decode_array(&c->p);
    } else {
        return false;
    }
    return *n <= (uint64_t)(c->end - c->p); /* every element takes a byte at least */
}

static bool direct_is_nil(const direct_cursor *c)
{
    return c->p < c->end && (uint8_t)*c->p == 0xc0;
}

static bool direct_nil(direct_cursor *c)
{
    if (!direct_is_nil(c))
        return false;
    c->p++;
    return true;
}

/* An integer as msgpack-c reads it: *negative set for a value below 0 (then *value holds its
 * two's complement bits). */
__attribute__((always_inline)) static inline bool direct_int(direct_cursor *c, uint64_t *value,
                                                         bool *negative)
{
    enum mp_type t;
    if (!direct_peek(c, &t))
        return false;
    uint8_t first = (uint8_t)*c->p;
    /* The forms small fields (a positive fixint) and engine hashes (a uint 64) take most, told
     * from the first byte. */
    if (first <= 0x7f) {
        c->p++;
        *value = first;
        *negative = false;
        return true;
    }
    if (first == 0xcf && c->end - c->p >= 9) {
        c->p++;
        *value = mp_load_u64(&c->p);
        *negative = false;
        return true;
    }
    if (t == MP_UINT) {
        if (mp_check_uint(c->p, c->end) > 0)
            return false;
        *value = mp_decode_uint(&c->p);
        *negative = false;
        return true;
    }
    if (t == MP_INT) {
        if (mp_check_int(c->p, c->end) > 0)
            return false;
        int64_t v = mp_decode_int(&c->p);
        *value = (uint64_t)v;
        *negative = v < 0;
        return true;
    }
    return false;
}

static bool direct_hashes(km_kv_decoder *dec, direct_cursor *c, km_kv_event *ev)
{
    uint32_t n;
    if (!direct_array(c, &n) || n > dec->config.max_hashes_per_event)
        return false;
    uint64_t *hashes = arena_alloc_array(&dec->results, n, sizeof *hashes);
    if (!hashes)
        return false;
    /* A run of uint 64s, the form most engine hashes take, is read without the type dispatch,
     * bounded once: the first `whole` of them fit before the end. */
    uint64_t whole = (uint64_t)(c->end - c->p) / 9;
    uint32_t run_end = n < whole ? n : (uint32_t)whole;
    uint32_t i = 0;
    const char *p = c->p; /* in a register through the run */
    while (i < run_end && (uint8_t)*p == 0xcf) {
        p++;
        hashes[i++] = mp_load_u64(&p);
    }
    c->p = p;
    for (; i < n; i++) {
        bool negative;
        if (!direct_int(c, &hashes[i], &negative))
            return false;
    }
    ev->block_hashes = hashes;
    ev->n_block_hashes = n;
    return true;
}

/* The medium: nil (GPU) or a string without NUL bytes within max_string_bytes. */
static bool direct_medium(km_kv_decoder *dec, direct_cursor *c, km_kv_event *ev)
{
    ev->medium = KM_KV_MEDIUM_GPU;
    if (direct_is_nil(c))
        return direct_nil(c);
    enum mp_type t;
    if (!direct_peek(c, &t) || t != MP_STR || mp_check_strl(c->p, c->end) > 0)
        return false;
    uint32_t n = mp_decode_strl(&c->p);
    if (n > (uint64_t)(c->end - c->p) || n > dec->config.max_string_bytes ||
        (n > 0 && memchr(c->p, 0, n)))
        return false;
    ev->medium_name = arena_copy_string(dec, c->p, n);
    c->p += n;
    if (!ev->medium_name)
        return false;
    ev->medium = medium_of_name(ev->medium_name, n);
    return true;
}

/* An optional field's value when it is not nil (direct_optional_u32, direct_optional_i64). */
static bool direct_u32_value(direct_cursor *c, bool *has, uint32_t *out)
{
    uint64_t v;
    bool negative;
    if (!direct_int(c, &v, &negative) || negative || v > UINT32_MAX)
        return false;
    *has = true;
    *out = (uint32_t)v;
    return true;
}

static bool direct_i64_value(direct_cursor *c, bool *has, int64_t *out)
{
    uint64_t v;
    bool negative;
    if (!direct_int(c, &v, &negative) || (!negative && v > INT64_MAX))
        return false;
    *has = true;
    *out = (int64_t)v;
    return true;
}

/* Optional fields, mostly nil: that case inline. */
__attribute__((always_inline)) static inline bool direct_optional_u32(direct_cursor *c, bool *has,
                                                                      uint32_t *out)
{
    return direct_is_nil(c) ? direct_nil(c) : direct_u32_value(c, has, out);
}

__attribute__((always_inline)) static inline bool direct_optional_i64(direct_cursor *c, bool *has,
                                                                      int64_t *out)
{
    return direct_is_nil(c) ? direct_nil(c) : direct_i64_value(c, has, out);
}

#ifdef KM_TOKENS_SSSE3
/* read_uint16_run's first part, four at a time while at least six are left (the 16 bytes loaded
 * lie within the 18 of six uint 16s): their tags (bytes 0, 3, 6 and 9) compared at once, their
 * big-endian values shuffled into four uint32s. Returns how many were read; *pp moves past them. */
__attribute__((target("ssse3"))) static uint32_t read_uint16_quads(const char **pp, uint32_t *out,
                                                                   uint32_t n)
{
    const __m128i tag = _mm_set1_epi8((char)0xcd);
    const __m128i order = _mm_setr_epi8(2, 1, -1, -1, 5, 4, -1, -1, 8, 7, -1, -1, 11, 10, -1, -1);
    const char *p = *pp;
    uint32_t *o = out;
    for (uint32_t left = n; left >= 6; left -= 4) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)p);
        if ((_mm_movemask_epi8(_mm_cmpeq_epi8(v, tag)) & 0x249) != 0x249)
            break;
        _mm_storeu_si128((__m128i *)(void *)o, _mm_shuffle_epi8(v, order));
        o += 4;
        p += 12;
    }
    *pp = p;
    return (uint32_t)(o - out);
}
#endif

/* Read the uint 16s at *pp while they last, at most n (and at least one) of them, all n of which
 * would fit before the payload's end: their values go to out, *pp moves past them. Returns how
 * many were read. ssse3: read_uint16_quads may run. */
static uint32_t read_uint16_run(const char **pp, uint32_t *out, uint32_t n, bool ssse3)
{
    uint32_t *o = out;
    uint32_t left = n;
#ifdef KM_TOKENS_SSSE3
    if (ssse3 && left >= 6) {
        uint32_t k = read_uint16_quads(pp, o, left);
        o += k;
        left -= k;
    }
#else
    (void)ssse3;
#endif
    const char *p = *pp;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* Three at a time: their tags (bytes 0, 3 and 6) in one word, their values in the next
     * word, byte-swapped, at bits 48, 24 and 0. */
    for (; left >= 3; left -= 3) {
        uint64_t tags, values;
        memcpy(&tags, p, sizeof tags);
        if ((tags & UINT64_C(0x00FF0000FF0000FF)) != UINT64_C(0x00CD0000CD0000CD))
            break;
        memcpy(&values, p + 1, sizeof values);
        values = __builtin_bswap64(values);
        o[0] = (uint32_t)(values >> 48);
        o[1] = (uint32_t)(values >> 24) & 0xFFFFu;
        o[2] = (uint32_t)values & 0xFFFFu;
        o += 3;
        p += 9;
    }
#endif
    for (; left && (uint8_t)*p == 0xcd; left--) {
        p++;
        *o++ = mp_load_u16(&p);
    }
    *pp = p;
    return (uint32_t)(o - out);
}

/* [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
 * group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]: the first four fields required;
 * lora_name, extra_keys and kv_cache_spec_kind only as nil. */
static bool direct_stored(km_kv_decoder *dec, direct_cursor *c, uint32_t n_fields, km_kv_event *ev)
{
    if (n_fields < STORED_BLOCK_SIZE + 1 || n_fields > STORED_POSITIONAL_COUNT)
        return false;
    ev->kind = KM_KV_EVENT_BLOCK_STORED;
    if (!direct_hashes(dec, c, ev))
        return false;
    if (direct_is_nil(c)) {
        if (!direct_nil(c))
            return false;
    } else {
        bool negative;
        if (!direct_int(c, &ev->parent_block_hash, &negative))
            return false;
        ev->has_parent_block_hash = true;
    }
    uint32_t n_tokens;
    if (!direct_array(c, &n_tokens) || n_tokens > dec->config.max_tokens_per_event)
        return false;
    uint32_t *tokens = arena_alloc_array(&dec->results, n_tokens, sizeof *tokens);
    if (!tokens)
        return false;
    /* The bulk of a message: unsigned values, each read with one type check. */
    uint32_t i = 0;
    const char *p = c->p, *end = c->end; /* in registers through the common loop */
    while (i < n_tokens && p < end) {
        /* The forms token ids take are told from their first byte without msgpuck's type
         * dispatch, each read only when whole; anything else goes to the checked loop below. */
        uint8_t first = (uint8_t)*p;
        if (first == 0xcd && end - p >= 3) {
            /* A run of uint 16s, the form most token ids take, bounded once: the first `whole`
             * of them fit before the end (this one at least). */
            size_t whole = (size_t)(end - p) / 3;
            uint32_t run_end = n_tokens - i < whole ? n_tokens : i + (uint32_t)whole;
            i += read_uint16_run(&p, tokens + i, run_end - i, dec->ssse3);
        } else if (first <= 0x7f) {
            tokens[i++] = first;
            p++;
        } else if (first == 0xce && end - p >= 5) {
            p++;
            tokens[i++] = mp_load_u32(&p);
        } else if (mp_typeof(*p) == MP_UINT && mp_check_uint(p, end) <= 0) {
            uint64_t v = mp_decode_uint(&p);
            if (v > UINT32_MAX)
                return false;
            tokens[i++] = (uint32_t)v;
        } else {
            break;
        }
    }
    c->p = p;
    for (; i < n_tokens; i++) {
        if (c->p >= c->end)
            return false;
        if (mp_typeof(*c->p) == MP_UINT) {
            if (mp_check_uint(c->p, c->end) > 0)
                return false;
            uint64_t v = mp_decode_uint(&c->p);
            if (v > UINT32_MAX)
                return false;
            tokens[i] = (uint32_t)v;
            continue;
        }
        uint64_t v;
        bool negative;
        if (!direct_int(c, &v, &negative) || negative || v > UINT32_MAX)
            return false;
        tokens[i] = (uint32_t)v;
    }
    ev->token_ids = tokens;
    ev->n_token_ids = n_tokens;
    uint64_t block_size;
    bool negative;
    if (!direct_int(c, &block_size, &negative) || negative || block_size > UINT32_MAX ||
        (uint64_t)block_size * ev->n_block_hashes != n_tokens)
        return false; /* the tree path rejects the event, with its reason */
    /* block_size 0 is a placeholder store (no tokens, no parent), checked for its medium below. */
    ev->placeholder = block_size == 0;
    if (ev->placeholder && (n_tokens || ev->has_parent_block_hash))
        return false;
    ev->block_size = (uint32_t)block_size;
    for (uint32_t f = STORED_LORA_ID; f < n_fields; f++) {
        bool ok;
        switch (f) {
        case STORED_LORA_ID: ok = direct_optional_i64(c, &ev->has_lora_id, &ev->lora_id); break;
        case STORED_MEDIUM: ok = direct_medium(dec, c, ev); break;
        case STORED_GROUP_IDX: ok = direct_optional_u32(c, &ev->has_group_idx, &ev->group_idx); break;
        case STORED_KV_CACHE_SPEC_SLIDING_WINDOW:
            ok = direct_optional_i64(c, &ev->has_kv_cache_spec_sliding_window,
                                     &ev->kv_cache_spec_sliding_window);
            break;
        default: ok = direct_nil(c); break; /* lora_name, extra_keys, kv_cache_spec_kind */
        }
        if (!ok)
            return false;
    }
    return !(ev->placeholder && ev->medium == KM_KV_MEDIUM_GPU); /* the tree path rejects it */
}

/* [tag, block_hashes, medium, group_idx], the last two optional. */
static bool direct_removed(km_kv_decoder *dec, direct_cursor *c, uint32_t n_fields, km_kv_event *ev)
{
    if (n_fields < 1 || n_fields > REMOVED_FIELD_COUNT)
        return false;
    ev->kind = KM_KV_EVENT_BLOCK_REMOVED;
    ev->medium = KM_KV_MEDIUM_GPU;
    if (!direct_hashes(dec, c, ev))
        return false;
    if (n_fields > REMOVED_MEDIUM && !direct_medium(dec, c, ev))
        return false;
    if (n_fields > REMOVED_GROUP_IDX && !direct_optional_u32(c, &ev->has_group_idx, &ev->group_idx))
        return false;
    return true;
}

/* Are the len bytes at tag those of name (8 to 16 bytes long, as every event tag is)? Two
 * overlapping words each, so that no call to memcmp is made. */
static inline bool tag_is(const char *tag, const char *name, size_t len)
{
    uint64_t t0, t1, n0, n1;
    memcpy(&t0, tag, 8);
    memcpy(&t1, tag + len - 8, 8);
    memcpy(&n0, name, 8);
    memcpy(&n1, name + len - 8, 8);
    return ((t0 ^ n0) | (t1 ^ n1)) == 0;
}

/* Read one event into ev, which arrives zeroed (decode_direct zeroes a batch's events at once). */
static bool direct_event(km_kv_decoder *dec, direct_cursor *c, km_kv_event *ev)
{
    uint32_t n;
    enum mp_type t;
    if (!direct_array(c, &n) || n < 1 || !direct_peek(c, &t) || t != MP_STR ||
        mp_check_strl(c->p, c->end) > 0)
        return false;
    uint32_t len = mp_decode_strl(&c->p);
    if (len > (uint64_t)(c->end - c->p))
        return false;
    const char *tag = c->p;
    c->p += len;
#define TAG_IS(name) (len == sizeof(name) - 1 && tag_is(tag, name, sizeof(name) - 1))
    if (TAG_IS("BlockStored"))
        return direct_stored(dec, c, n - 1, ev);
    if (TAG_IS("BlockRemoved"))
        return direct_removed(dec, c, n - 1, ev);
    if (TAG_IS("AllBlocksCleared") && n == 1) {
        ev->kind = KM_KV_EVENT_ALL_BLOCKS_CLEARED;
        return true;
    }
#undef TAG_IS
    return false;
}

/* KM_OK with *out filled, DIRECT_DECLINED (the arena may hold partial results), or
 * KM_ERR_OUT_OF_MEMORY never: an allocation failure declines too, and the tree path reports it. */
static int decode_direct(km_kv_decoder *dec, const void *payload, size_t size, km_kv_batch *out)
{
    if (size > dec->config.max_payload_objects)
        return DIRECT_DECLINED; /* it might hold too many values (direct_cursor) */
    direct_cursor c = {payload, (const char *)payload + size};
    uint32_t n_items, n_events;
    if (!direct_array(&c, &n_items) || n_items < 2 || n_items > 3)
        return DIRECT_DECLINED;
    enum mp_type t;
    if (!direct_peek(&c, &t))
        return DIRECT_DECLINED;
    if (t == MP_DOUBLE && mp_check_double(c.p, c.end) <= 0) {
        out->timestamp = mp_decode_double(&c.p);
    } else if (t == MP_FLOAT && mp_check_float(c.p, c.end) <= 0) {
        out->timestamp = mp_decode_float(&c.p);
    } else {
        uint64_t v;
        bool negative;
        if (!direct_int(&c, &v, &negative))
            return DIRECT_DECLINED;
        out->timestamp = negative ? (double)(int64_t)v : (double)v;
    }
    if (!direct_array(&c, &n_events) || n_events > dec->config.max_events_per_batch)
        return DIRECT_DECLINED;
    km_kv_event *events = arena_alloc_array(&dec->results, n_events, sizeof *events);
    km_kv_rejected_event *rejected =
        arena_alloc_array(&dec->results, n_events, sizeof(km_kv_rejected_event));
    if (!events || !rejected)
        return DIRECT_DECLINED;
    if (n_events) /* the fields an event's reader leaves unset read as absent */
        memset(events, 0, n_events * sizeof *events);
    for (uint32_t i = 0; i < n_events; i++) {
        if (!direct_event(dec, &c, &events[i]))
            return DIRECT_DECLINED;
        events[i].position = i;
    }
    if (n_items == 3 && !direct_optional_u32(&c, &out->has_data_parallel_rank,
                                             &out->data_parallel_rank))
        return DIRECT_DECLINED;
    if (c.p != c.end)
        return DIRECT_DECLINED;
    out->events = events;
    out->n_events = n_events;
    out->rejected = rejected;
    out->n_payload_events = n_events;
    return KM_OK;
}

/* ---- entry points ---------------------------------------------------------------------------- */

static void begin_call(km_kv_decoder *dec)
{
    dec->last_error[0] = 0;
    dec->event_type = NULL;
    arena_reset(&dec->results);
}

static int decode_payload_into(km_kv_decoder *dec, const void *payload, size_t size,
                               km_kv_batch *out)
{
    if (!payload && size)
        return decoder_fail(dec, KM_ERR_NULL_POINTER, "payload is NULL with size %zu", size);
    if (size == 0)
        return decoder_fail(dec, KM_ERR_PARSE, "empty payload");
    if (size > dec->config.max_payload_bytes)
        return decoder_fail(dec, KM_ERR_TOO_LARGE,
                            "payload is %zu bytes, limit max_payload_bytes = %llu", size,
                            (unsigned long long)dec->config.max_payload_bytes);
    if (dec->direct_path) {
        arena_mark mark = arena_get_mark(&dec->results); /* a message's topic may be in the arena */
        if (decode_direct(dec, payload, size, out) == KM_OK) {
            dec->direct_decoded++;
            return KM_OK;
        }
        arena_rewind(&dec->results, mark); /* declined: start again on the tree path */
        memset(out, 0, sizeof *out);
    }
    km_msgpack_scan_result shape;
    int rc = prescan_payload(dec, payload, size, &shape);
    if (rc != KM_OK)
        return rc;
    if ((rc = ensure_zone(dec, shape.zone_bytes)) != KM_OK)
        return rc;
    msgpack_object root;
    size_t offset = 0;
    /* After ensure_zone / msgpack_zone_clear the zone hands out its first chunk from here. */
    uintptr_t first_chunk = (uintptr_t)dec->zone.chunk_list.ptr;
    msgpack_unpack_return unpacked = msgpack_unpack(payload, size, &offset, &dec->zone, &root);
    if (unpacked == MSGPACK_UNPACK_SUCCESS)
        rc = decode_batch(dec, &root, out);
    else if (unpacked == MSGPACK_UNPACK_NOMEM_ERROR)
        rc = decoder_fail(dec, KM_ERR_OUT_OF_MEMORY,
                          "msgpack-c ran out of memory unpacking %zu bytes", size);
    else
        rc = decoder_fail(dec, KM_ERR_INTERNAL,
                          "msgpack-c returned %d for a payload the pre-scan accepted",
                          (int)unpacked);
    /* The pre-scan sized the first chunk; a pointer outside it means msgpack-c took another
     * chunk (the estimate was short): grow before the next payload, so that steady state stays
     * allocation-free. */
    uintptr_t now = (uintptr_t)dec->zone.chunk_list.ptr;
    if (now < first_chunk || now > first_chunk + dec->zone_chunk_bytes)
        dec->zone_overflowed = true;
    msgpack_zone_clear(&dec->zone);
    return rc;
}

static int finish_call(km_kv_decoder *dec, int rc, km_kv_batch *batch)
{
    if (rc != KM_OK) {
        dec->stats.messages_rejected++;
        return rc;
    }
    dec->stats.messages_decoded++;
    if (batch) {
        dec->stats.events_decoded += batch->n_events;
        dec->stats.events_rejected += batch->n_rejected;
        dec->stats.events_unknown += batch->n_unknown_events;
    }
    return KM_OK;
}

int km_kv_decode_payload(km_kv_decoder *dec, const void *payload, size_t payload_size,
                         km_kv_batch *out)
{
    if (!dec)
        return KM_ERR_NULL_POINTER;
    begin_call(dec);
    if (!out)
        return finish_call(dec, decoder_fail(dec, KM_ERR_NULL_POINTER, "out is NULL"), NULL);
    memset(out, 0, sizeof *out);
    int rc = decode_payload_into(dec, payload, payload_size, out);
    if (rc != KM_OK)
        memset(out, 0, sizeof *out);
    return finish_call(dec, rc, out);
}

static int check_frame(km_kv_decoder *dec, const km_kv_frame *frames, size_t i)
{
    if (frames[i].size && !frames[i].data)
        return decoder_fail(dec, KM_ERR_NULL_POINTER, "frame %zu has %zu bytes but no data", i,
                            frames[i].size);
    return KM_OK;
}

static int decode_message_into(km_kv_decoder *dec, km_kv_source source, const km_kv_frame *frames,
                               size_t n_frames, km_kv_message *out)
{
    size_t topic_index = SIZE_MAX, seq_index, payload_index;
    const char *what;
    switch (source) {
    case KM_KV_SOURCE_SUBSCRIBER:
        what = "live message";
        if (n_frames != 3)
            return decoder_fail(dec, KM_ERR_PARSE,
                                "live message has %zu frames, expected 3 (topic, seq, payload)",
                                n_frames);
        topic_index = 0;
        seq_index = 1;
        payload_index = 2;
        out->kind = KM_KV_MESSAGE_LIVE;
        break;
    case KM_KV_SOURCE_REPLAY:
        what = "replay reply";
        if (n_frames != 3 && n_frames != 4)
            return decoder_fail(
                dec, KM_ERR_PARSE,
                "replay reply has %zu frames, expected 3 ([empty, seq, payload], up to "
                "v0.25) or 4 ([empty, topic, seq, payload], v0.26+)",
                n_frames);
        if (!frames)
            return decoder_fail(dec, KM_ERR_NULL_POINTER, "frames is NULL");
        if (frames[0].size != 0)
            return decoder_fail(dec, KM_ERR_PARSE,
                                "replay reply frame 0 has %zu bytes, expected the empty delimiter "
                                "(frames must come from a DEALER socket)",
                                frames[0].size);
        if (n_frames == 4)
            topic_index = 1;
        seq_index = n_frames - 2;
        payload_index = n_frames - 1;
        out->kind = KM_KV_MESSAGE_REPLAY_ITEM;
        break;
    default:
        return decoder_fail(dec, KM_ERR_INVALID_ARGUMENT, "unknown km_kv_source %d", (int)source);
    }
    if (!frames)
        return decoder_fail(dec, KM_ERR_NULL_POINTER, "frames is NULL");
    for (size_t i = 0; i < n_frames; i++) {
        int rc = check_frame(dec, frames, i);
        if (rc != KM_OK)
            return rc;
    }
    out->topic = "";
    if (topic_index != SIZE_MAX) {
        const km_kv_frame *topic = &frames[topic_index];
        if (topic->size > dec->config.max_string_bytes)
            return decoder_fail(dec, KM_ERR_TOO_LARGE,
                                "%s topic frame is %zu bytes, limit max_string_bytes = %u", what,
                                topic->size, dec->config.max_string_bytes);
        out->topic = arena_copy_string(dec, topic->data, topic->size);
        if (!out->topic)
            return out_of_memory(dec, "the topic");
        out->topic_size = (uint32_t)topic->size;
        out->has_topic = true;
    }
    const km_kv_frame *seq = &frames[seq_index];
    if (seq->size != 8)
        return decoder_fail(dec, KM_ERR_PARSE,
                            "%s seq frame (frame %zu) has %zu bytes, expected 8 (big-endian u64)",
                            what, seq_index, seq->size);
    out->seq = km_read_be(seq->data, 8);
    const km_kv_frame *payload = &frames[payload_index];
    if (source == KM_KV_SOURCE_REPLAY && out->seq == KM_KV_REPLAY_END_SEQ) {
        if (payload->size != 0)
            return decoder_fail(
                dec, KM_ERR_PARSE,
                "replay end marker (seq 0xffffffffffffffff) carries a %zu-byte payload; "
                "it must be empty",
                payload->size);
        out->kind = KM_KV_MESSAGE_REPLAY_END;
        return KM_OK;
    }
    if (payload->size == 0)
        return decoder_fail(dec, KM_ERR_PARSE, "%s seq %llu has an empty payload%s", what,
                            (unsigned long long)out->seq,
                            out->seq == KM_KV_REPLAY_END_SEQ
                                ? " (a replay end marker, but this came from the SUB socket)"
                                : "");
    return decode_payload_into(dec, payload->data, payload->size, &out->batch);
}

int km_kv_decode_message(km_kv_decoder *dec, km_kv_source source, const km_kv_frame *frames,
                         size_t n_frames, km_kv_message *out)
{
    if (!dec)
        return KM_ERR_NULL_POINTER;
    begin_call(dec);
    if (!out)
        return finish_call(dec, decoder_fail(dec, KM_ERR_NULL_POINTER, "out is NULL"), NULL);
    memset(out, 0, sizeof *out);
    int rc = decode_message_into(dec, source, frames, n_frames, out);
    if (rc != KM_OK)
        memset(out, 0, sizeof *out);
    return finish_call(dec, rc, &out->batch);
}
