/* SPDX-License-Identifier: Apache-2.0 */
/* The router protocol's decoder (include/kvmatch/protocol.h, "decoder", docs/PROTOCOL.md): one
 * frame payload into a km_message, every field checked within the configured limits.
 *
 * Decoding a payload goes through three stages, each bounded before the next one spends memory
 * (the same plan as src/events/kv_events.c):
 *  1. km_msgpack_scan (src/base/msgpack_scan.h) walks the raw bytes once without allocating:
 *     exactly one complete value, no container declaring more elements than there are bytes
 *     left, nesting within msgpack-c's stack, at most max_objects values.
 *  2. msgpack_unpack builds the object tree in the decoder's zone.
 *  3. The schema walk checks every field and copies what the caller gets (strings NUL-terminated,
 *     arrays converted) into the same zone, so the result does not point into the payload.
 * The zone is cleared at the start of the next decode, which is the documented lifetime. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "kvmatch/protocol.h"
#include "base/msgpack_scan.h"
#include "base/utf8.h"
#include "service/protocol_internal.h"

#define ZONE_CHUNK_BYTES     ((size_t)64 << 10)
#define NO_ELEMENT           UINT64_MAX

/* ---- decoder: handle and errors -------------------------------------------------------------- */

struct km_protocol_decoder {
    km_protocol_limits limits;
    msgpack_zone zone;
    const void *first_chunk; /* the zone's chunk list head while it holds only its first chunk */
    /* Where an error is, while an item is decoded: "routes[3]", "decisions[2].candidates[5]".
     * Kept as (name, index) pairs and formatted only when an error is reported: a reply of 64
     * decisions with 16 candidates each would otherwise format 1,088 paths nobody reads. */
    struct {
        const char *name;
        uint32_t index;
    } path[2];
    unsigned path_depth;
    char error[ERROR_BYTES];     /* the failure being reported */
    char last_error[ERROR_BYTES];
};

static bool limits_valid(const km_protocol_limits *l)
{
    return l->max_frame_bytes && l->max_objects && l->max_batch_items && l->max_tokens_per_route &&
           l->max_hashes_per_route && l->max_candidates && l->max_params && l->max_string_bytes;
}

int km_protocol_decoder_create(const km_protocol_limits *limits, km_protocol_decoder **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_protocol_limits l;
    if (limits)
        l = *limits;
    else
        km_protocol_limits_init(&l);
    if (!limits_valid(&l))
        return KM_ERR_INVALID_ARGUMENT;
    km_protocol_decoder *d = calloc(1, sizeof *d);
    if (!d)
        return KM_ERR_OUT_OF_MEMORY;
    if (!msgpack_zone_init(&d->zone, ZONE_CHUNK_BYTES)) {
        free(d);
        return KM_ERR_OUT_OF_MEMORY;
    }
    d->first_chunk = d->zone.chunk_list.head;
    d->limits = l;
    *out = d;
    return KM_OK;
}

void km_protocol_decoder_destroy(km_protocol_decoder *d)
{
    if (!d)
        return;
    msgpack_zone_destroy(&d->zone);
    free(d);
}

const char *km_protocol_decoder_last_error(const km_protocol_decoder *d)
{
    return d ? d->last_error : "";
}

void km_protocol_decoder_release(km_protocol_decoder *d)
{
    /* A zone that grew has a new chunk at its head. msgpack_zone_clear would keep that one (the
     * largest), so start a fresh zone instead; if even that cannot be had, keep the old one. */
    if (!d || d->zone.chunk_list.head == d->first_chunk)
        return;
    msgpack_zone fresh;
    if (!msgpack_zone_init(&fresh, ZONE_CHUNK_BYTES)) {
        msgpack_zone_clear(&d->zone);
        return;
    }
    msgpack_zone_swap(&d->zone, &fresh);
    msgpack_zone_destroy(&fresh);
    d->first_chunk = d->zone.chunk_list.head;
}

/* "KM_ERR_PARSE: routes[3].tokens[7]: " + the sentence, into d->error. `field` may be NULL,
 * `element` NO_ELEMENT. */
KM_PRINTF(5, 6)
static int field_fail(km_protocol_decoder *d, int status, const char *field, uint64_t element,
                      const char *fmt, ...)
{
    size_t cap = sizeof d->error;
    int n = snprintf(d->error, cap, "%s: ", km_error_name(status));
    for (unsigned k = 0; k < d->path_depth && n > 0 && (size_t)n < cap; k++)
        n += snprintf(d->error + n, cap - (size_t)n, "%s%s[%" PRIu32 "]", k ? "." : "",
                      d->path[k].name, d->path[k].index);
    if (n > 0 && (size_t)n < cap && (d->path_depth || field)) {
        n += snprintf(d->error + n, cap - (size_t)n, "%s%s", d->path_depth && field ? "." : "",
                      field ? field : "");
        if (n > 0 && (size_t)n < cap && element != NO_ELEMENT)
            n += snprintf(d->error + n, cap - (size_t)n, "[%" PRIu64 "]", element);
        if (n > 0 && (size_t)n < cap)
            n += snprintf(d->error + n, cap - (size_t)n, ": ");
    }
    if (n > 0 && (size_t)n < cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(d->error + n, cap - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return status;
}

static int out_of_memory(km_protocol_decoder *d)
{
    return field_fail(d, KM_ERR_OUT_OF_MEMORY, NULL, NO_ELEMENT, "cannot allocate decode memory");
}

static void *zone_array(km_protocol_decoder *d, size_t count, size_t size)
{
    if (count == 0)
        count = 1; /* a valid pointer for empty arrays */
    if (count > SIZE_MAX / size)
        return NULL;
    void *p = msgpack_zone_malloc(&d->zone, count * size);
    if (p)
        memset(p, 0, count * size);
    return p;
}

/* ---- stage 1: bounded pre-scan --------------------------------------------------------------- */

_Static_assert(KM_PROTOCOL_MAX_NESTING_DEPTH <= KM_MSGPACK_SCAN_MAX_DEPTH,
               "the scanner cannot follow the nesting the header promises");

static int prescan(km_protocol_decoder *d, const uint8_t *p, size_t size)
{
    const km_msgpack_limits limits = {
        .max_depth = KM_PROTOCOL_MAX_NESTING_DEPTH,
        .max_objects = d->limits.max_objects,
        .max_objects_name = "max_objects",
        .value_name = "the message map (a frame holds exactly one value)",
    };
    km_msgpack_scan_result scan;
    int rc = km_msgpack_scan(p, size, &limits, &scan);
    if (rc == KM_OK)
        return KM_OK;
    char why[ERROR_BYTES];
    km_msgpack_scan_explain(&limits, &scan, why, sizeof why);
    return field_fail(d, rc, NULL, NO_ELEMENT, "%s", why);
}

/* ---- stage 3: field readers ------------------------------------------------------------------ */

/* Wire names to enum values, from the header's X-macro lists: the value whose name is s[0..n), or
 * the list's value 0 (UNKNOWN, NONE), which no wire string stands for. */
#define NAMED_ENTRY(enumerator, value, name)                                                    \
    if ((value) != 0 && n == sizeof(name) - 1 && memcmp(s, name, n) == 0)                       \
        return enumerator;
#define DEFINE_NAMED(function, type, list)                                                      \
    static type function(const char *s, size_t n)                                              \
    {                                                                                          \
        list(NAMED_ENTRY) return (type)0;                                                      \
    }
DEFINE_NAMED(message_type_named, km_message_type, KM_MESSAGE_TYPE_LIST)
DEFINE_NAMED(prediction_source_named, km_prediction_source, KM_PREDICTION_SOURCE_LIST)
DEFINE_NAMED(lifecycle_kind_named, km_lifecycle_kind, KM_LIFECYCLE_KIND_LIST)
DEFINE_NAMED(outcome_named, km_outcome, KM_OUTCOME_LIST)
DEFINE_NAMED(admin_action_named, km_admin_action, KM_ADMIN_ACTION_LIST)
#undef DEFINE_NAMED
#undef NAMED_ENTRY

/* Unknown string keys compared pairwise up to this many; more are sorted first. */
#define FEW_UNKNOWN_KEYS 16

static bool same_key(const msgpack_object *a, const msgpack_object *b)
{
    /* An empty key's ptr may be NULL, which memcmp must not be given even for 0 bytes. */
    return a->via.str.size == b->via.str.size &&
           (a->via.str.size == 0 || memcmp(a->via.str.ptr, b->via.str.ptr, a->via.str.size) == 0);
}

/* Two string keys: by length, then by bytes (a qsort order over msgpack_object pointers). */
static int key_order(const void *pa, const void *pb)
{
    const msgpack_object *a = *(const msgpack_object *const *)pa;
    const msgpack_object *b = *(const msgpack_object *const *)pb;
    if (a->via.str.size != b->via.str.size)
        return a->via.str.size < b->via.str.size ? -1 : 1;
    return a->via.str.size ? memcmp(a->via.str.ptr, b->via.str.ptr, a->via.str.size) : 0;
}

/* The string keys of map at the n indexes keys[] (no name of the schema's): KM_ERR_PARSE naming
 * one that appears twice, else KM_OK. Pairwise for a few; a hostile map may hold up to
 * max_objects of them, so more are sorted (pointers in the decoder's zone) and compared with
 * their neighbours. */
static int unknown_twice(km_protocol_decoder *d, const msgpack_object *map, const uint32_t *keys,
                         uint32_t n)
{
    const msgpack_object_kv *kv = map->via.map.ptr;
    const msgpack_object *twice = NULL;
    if (n <= FEW_UNKNOWN_KEYS) {
        for (uint32_t a = 1; a < n && !twice; a++)
            for (uint32_t b = 0; b < a && !twice; b++)
                if (same_key(&kv[keys[a]].key, &kv[keys[b]].key))
                    twice = &kv[keys[a]].key;
    } else {
        const msgpack_object **sorted = zone_array(d, n, sizeof *sorted);
        if (!sorted)
            return out_of_memory(d);
        for (uint32_t a = 0; a < n; a++)
            sorted[a] = &kv[keys[a]].key;
        qsort(sorted, n, sizeof *sorted, key_order);
        for (uint32_t a = 1; a < n && !twice; a++)
            if (same_key(sorted[a - 1], sorted[a]))
                twice = sorted[a];
    }
    if (!twice)
        return KM_OK;
    int shown = twice->via.str.size > 64 ? 64 : (int)twice->via.str.size;
    return field_fail(d, KM_ERR_PARSE, NULL, NO_ELEMENT,
                      "key \"%.*s\" appears twice in one map", shown, twice->via.str.ptr);
}

/* A map's known fields: values[i] is the value of names[i], NULL when absent or nil (nil and
 * absent mean the same for every optional field). Entries whose key is not a string are ignored,
 * and so are string keys no name matches; any string key twice, known or not, is KM_ERR_PARSE.
 * A failed map still has every field bound (a repeated one to its first value), so the message
 * that holds it is answered with its id wherever the repeat is. */
#define MAX_FIELDS 32

static int bind_fields(km_protocol_decoder *d, const msgpack_object *map, const char *what,
                       const char *const *names, unsigned n_names, const msgpack_object **values)
{
    bool seen[MAX_FIELDS] = {false};
    for (unsigned i = 0; i < n_names; i++)
        values[i] = NULL;
    if (map->type != MSGPACK_OBJECT_MAP)
        return field_fail(d, KM_ERR_PARSE, what, NO_ELEMENT, "expected a map, got %s",
                          km_msgpack_type_name(map));
    uint32_t few[FEW_UNKNOWN_KEYS], *unknown = few, n_unknown = 0;
    unsigned start = 0; /* keys usually come in schema order: try the next name first */
    int twice = KM_OK;  /* a known key repeated: reported once every field is bound */
    for (uint32_t k = 0; k < map->via.map.size; k++) {
        const msgpack_object *key = &map->via.map.ptr[k].key;
        if (key->type != MSGPACK_OBJECT_STR)
            continue;
        const char *kp = key->via.str.ptr;
        uint32_t kn = key->via.str.size;
        unsigned t = kn ? 0 : n_names;
        for (; t < n_names; t++) {
            unsigned i = start + t < n_names ? start + t : start + t - n_names;
            /* Length first: a key with an embedded NUL ("status\0x") must not pass a strncmp
             * and send the names[i][kn] check past the end of the shorter name. */
            if (names[i][0] != kp[0] || strnlen(names[i], kn + 1) != kn ||
                memcmp(names[i], kp, kn) != 0)
                continue;
            start = i + 1 < n_names ? i + 1 : 0;
            if (seen[i]) {
                if (!twice)
                    twice = field_fail(d, KM_ERR_PARSE, names[i], NO_ELEMENT,
                                       "field appears twice in one map");
                break;
            }
            seen[i] = true;
            const msgpack_object *v = &map->via.map.ptr[k].val;
            values[i] = v->type == MSGPACK_OBJECT_NIL ? NULL : v;
            break;
        }
        if (t < n_names)
            continue;
        if (n_unknown == FEW_UNKNOWN_KEYS && unknown == few) {
            unknown = zone_array(d, map->via.map.size, sizeof *unknown);
            if (!unknown)
                return out_of_memory(d);
            memcpy(unknown, few, sizeof few);
        }
        unknown[n_unknown++] = k;
    }
    if (twice)
        return twice;
    return n_unknown > 1 ? unknown_twice(d, map, unknown, n_unknown) : KM_OK;
}

static int missing(km_protocol_decoder *d, const char *field)
{
    return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "required field is missing");
}

static int read_u64_element(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                            uint64_t element, uint64_t max, uint64_t *out)
{
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER || o->via.u64 > max)
        return field_fail(d, KM_ERR_PARSE, field, element, "expected an int in 0..%" PRIu64 ", got %s",
                          max, o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? "a larger int"
                                                                          : km_msgpack_type_name(o));
    *out = o->via.u64;
    return KM_OK;
}

static int read_u64(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                    uint64_t *out)
{
    return read_u64_element(d, o, field, NO_ELEMENT, UINT64_MAX, out);
}

/* A count of tokens or blocks: 0..2^63-1, as the records' signed 64-bit integers hold it (a
 * larger one, such as a router's all-ones "unknown", is refused rather than lost from a record). */
static int read_count(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                      uint64_t *out)
{
    return read_u64_element(d, o, field, NO_ELEMENT, (uint64_t)INT64_MAX, out);
}

static int read_u32(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                    uint32_t *out)
{
    uint64_t v = 0;
    int rc = read_u64_element(d, o, field, NO_ELEMENT, UINT32_MAX, &v);
    if (!rc)
        *out = (uint32_t)v;
    return rc;
}

/* A status code: 0 or a negative int in int32 range. */
static int read_status(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                       int *out)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 == 0) {
        *out = 0;
        return KM_OK;
    }
    if (o->type != MSGPACK_OBJECT_NEGATIVE_INTEGER || o->via.i64 < INT32_MIN)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT,
                          "expected 0 or a negative int32 status code, got %s",
                          km_msgpack_type_name(o));
    *out = (int)o->via.i64;
    return KM_OK;
}

static int read_double(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                       double *out)
{
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)o->via.u64; return KM_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)o->via.i64; return KM_OK;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *out = o->via.f64; return KM_OK;
    default:
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "expected a number, got %s",
                          km_msgpack_type_name(o));
    }
}

static int read_bool(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                     bool *out)
{
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "expected a bool, got %s",
                          km_msgpack_type_name(o));
    *out = o->via.boolean;
    return KM_OK;
}

static int copy_string(km_protocol_decoder *d, const char *s, size_t n, const char **out)
{
    char *copy = msgpack_zone_malloc(&d->zone, n + 1);
    if (!copy)
        return out_of_memory(d);
    if (n)
        memcpy(copy, s, n);
    copy[n] = 0;
    *out = copy;
    return KM_OK;
}

/* A str within max_string_bytes, well-formed UTF-8 (docs/PROTOCOL.md) and without NUL, copied
 * NUL-terminated. */
static int read_str(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                    const char **out)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "expected a str, got %s",
                          km_msgpack_type_name(o));
    uint32_t n = o->via.str.size;
    if (n > d->limits.max_string_bytes)
        return field_fail(d, KM_ERR_TOO_LARGE, field, NO_ELEMENT,
                          "string of %u bytes, max_string_bytes is %u", n,
                          d->limits.max_string_bytes);
    if (n && memchr(o->via.str.ptr, 0, n))
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "string contains a NUL byte");
    size_t bad = km_utf8_bad_offset((const unsigned char *)o->via.str.ptr, n);
    if (bad < n)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT,
                          "string is not UTF-8 (byte %zu of %u)", bad, n);
    return copy_string(d, o->via.str.ptr, n, out);
}

static int read_nonempty_str(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                             const char **out)
{
    if (!o)
        return missing(d, field);
    int rc = read_str(d, o, field, out);
    if (!rc && !(*out)[0])
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "must not be empty");
    return rc;
}

/* Optional readers: leave *out untouched when the field is absent. */
#define OPT(call, value) ((value) ? (call) : KM_OK)
/* OPT that also sets *has when the value was present and read. */
#define OPT_HAS(call, value, has) ((value) ? opt_read((call), (has)) : KM_OK)

static inline int opt_read(int rc, bool *has)
{
    if (rc == KM_OK)
        *has = true;
    return rc;
}

static int check_array_object(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                              uint32_t limit, const char *limit_name)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "expected an array, got %s",
                          km_msgpack_type_name(o));
    if (o->via.array.size > limit)
        return field_fail(d, KM_ERR_TOO_LARGE, field, NO_ELEMENT, "%u entries, %s is %u",
                          o->via.array.size, limit_name, limit);
    return KM_OK;
}

static int read_u32_array(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                          uint32_t limit, const char *limit_name, const uint32_t **out,
                          uint32_t *n_out)
{
    int rc = check_array_object(d, o, field, limit, limit_name);
    if (rc)
        return rc;
    uint32_t n = o->via.array.size;
    uint32_t *v = zone_array(d, n, sizeof *v);
    if (!v)
        return out_of_memory(d);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t x = 0;
        rc = read_u64_element(d, &o->via.array.ptr[i], field, i, UINT32_MAX, &x);
        if (rc)
            return rc;
        v[i] = (uint32_t)x;
    }
    *out = v;
    *n_out = n;
    return KM_OK;
}

static int read_u64_array(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                          uint32_t limit, const char *limit_name, const uint64_t **out,
                          uint32_t *n_out)
{
    int rc = check_array_object(d, o, field, limit, limit_name);
    if (rc)
        return rc;
    uint32_t n = o->via.array.size;
    uint64_t *v = zone_array(d, n, sizeof *v);
    if (!v)
        return out_of_memory(d);
    for (uint32_t i = 0; i < n; i++) {
        rc = read_u64_element(d, &o->via.array.ptr[i], field, i, UINT64_MAX, &v[i]);
        if (rc)
            return rc;
    }
    *out = v;
    *n_out = n;
    return KM_OK;
}

/* attempt_id: a str, or a non-negative int kept as its decimal string. */
static int read_attempt_id(km_protocol_decoder *d, const msgpack_object *o, const char **out)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        char digits[24];
        int n = snprintf(digits, sizeof digits, "%" PRIu64, o->via.u64);
        return copy_string(d, digits, (size_t)n, out);
    }
    if (o->type != MSGPACK_OBJECT_STR)
        return field_fail(d, KM_ERR_PARSE, "attempt_id", NO_ELEMENT,
                          "expected a str or a non-negative int, got %s", km_msgpack_type_name(o));
    return read_str(d, o, "attempt_id", out);
}

static int read_load(km_protocol_decoder *d, const msgpack_object *o, km_worker_load *load)
{
    static const char *const names[] = {"in_flight", "pending_prefill_tokens",
                                        "active_decode_blocks"};
    const msgpack_object *v[3];
    int rc = bind_fields(d, o, "load", names, 3, v);
    if (!rc)
        rc = OPT(read_u32(d, v[0], "load.in_flight", &load->in_flight), v[0]);
    if (!rc)
        rc = OPT(read_u64(d, v[1], "load.pending_prefill_tokens", &load->pending_prefill_tokens),
                 v[1]);
    if (!rc)
        rc = OPT(read_u64(d, v[2], "load.active_decode_blocks", &load->active_decode_blocks), v[2]);
    return rc;
}

/* ---- stage 3: items -------------------------------------------------------------------------- */

static int decode_route(km_protocol_decoder *d, const msgpack_object *o, km_route_request *r)
{
    enum { REQUEST_ID, ATTEMPT_ID, MODEL, POOL, ENDPOINT, TOKENS, HASHES, BLOCK_SIZE, LORA_NAME,
           CACHE_SALT, CANDIDATES, POLICY, PROMPT_TOKENS, EXPECTED_OUTPUT_TOKENS, BRIEF, WARM_UPS,
           N_FIELDS };
    static const char *const names[N_FIELDS] = {
        "request_id", "attempt_id", "model",     "pool",       "endpoint",
        "tokens",     "hashes",     "block_size", "lora_name", "cache_salt",
        "candidates", "policy",     "prompt_tokens", "expected_output_tokens", "brief",
        "warm_ups"};
    const msgpack_object *v[N_FIELDS];
    const km_protocol_limits *l = &d->limits;
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc && o->type == MSGPACK_OBJECT_MAP) {
        /* A key twice: the item fails with that error, answered by its ids where they read. */
        char why[sizeof d->error];
        memcpy(why, d->error, sizeof why);
        if (v[REQUEST_ID])
            (void)read_nonempty_str(d, v[REQUEST_ID], "request_id", &r->request_id);
        if (v[ATTEMPT_ID])
            (void)read_attempt_id(d, v[ATTEMPT_ID], &r->attempt_id);
        memcpy(d->error, why, sizeof why);
    }
    if (rc)
        return rc;
    /* ids first, so even a failed item can be answered by request_id */
    if ((rc = read_nonempty_str(d, v[REQUEST_ID], "request_id", &r->request_id)))
        return rc;
    if ((rc = OPT(read_attempt_id(d, v[ATTEMPT_ID], &r->attempt_id), v[ATTEMPT_ID])))
        return rc;
    if ((rc = OPT(read_str(d, v[MODEL], "model", &r->model), v[MODEL])) ||
        (rc = OPT(read_str(d, v[POOL], "pool", &r->pool), v[POOL])) ||
        (rc = OPT(read_str(d, v[ENDPOINT], "endpoint", &r->endpoint), v[ENDPOINT])))
        return rc;
    if (v[TOKENS] && v[HASHES])
        return field_fail(d, KM_ERR_PARSE, "tokens", NO_ELEMENT,
                          "a route carries tokens or hashes, not both");
    if (!v[TOKENS] && !v[HASHES])
        return field_fail(d, KM_ERR_PARSE, "tokens", NO_ELEMENT,
                          "required field is missing (a route carries tokens or hashes)");
    if (v[TOKENS]) {
        r->input = KM_ROUTE_INPUT_TOKENS;
        rc = read_u32_array(d, v[TOKENS], "tokens", l->max_tokens_per_route,
                            "max_tokens_per_route", &r->tokens, &r->n_tokens);
    } else {
        r->input = KM_ROUTE_INPUT_HASHES;
        rc = read_u64_array(d, v[HASHES], "hashes", l->max_hashes_per_route,
                            "max_hashes_per_route", &r->hashes, &r->n_hashes);
    }
    if (rc)
        return rc;
    if ((rc = OPT(read_u32(d, v[BLOCK_SIZE], "block_size", &r->block_size), v[BLOCK_SIZE])))
        return rc;
    if (v[BLOCK_SIZE] && r->block_size == 0)
        return field_fail(d, KM_ERR_PARSE, "block_size", NO_ELEMENT, "must be at least 1");
    if ((rc = OPT(read_str(d, v[LORA_NAME], "lora_name", &r->lora_name), v[LORA_NAME])) ||
        (rc = OPT(read_str(d, v[CACHE_SALT], "cache_salt", &r->cache_salt), v[CACHE_SALT])) ||
        (rc = OPT(read_u32_array(d, v[CANDIDATES], "candidates", l->max_candidates,
                                 "max_candidates", &r->candidates, &r->n_candidates),
                  v[CANDIDATES])) ||
        (rc = OPT(read_str(d, v[POLICY], "policy", &r->policy), v[POLICY])))
        return rc;
    /* A route's token counts weigh in its decision: past KM_PROTOCOL_MAX_ROUTE_TOKENS they are
     * refused, not clamped into a decision the router did not ask for. */
    if (v[PROMPT_TOKENS]) {
        if ((rc = read_u64_element(d, v[PROMPT_TOKENS], "prompt_tokens", NO_ELEMENT,
                                   KM_PROTOCOL_MAX_ROUTE_TOKENS, &r->prompt_tokens)))
            return rc;
        r->has_prompt_tokens = true;
    }
    if (v[EXPECTED_OUTPUT_TOKENS]) {
        if ((rc = read_u64_element(d, v[EXPECTED_OUTPUT_TOKENS], "expected_output_tokens",
                                   NO_ELEMENT, KM_PROTOCOL_MAX_ROUTE_TOKENS,
                                   &r->expected_output_tokens)))
            return rc;
        r->has_expected_output_tokens = true;
    }
    if (v[BRIEF] && (rc = read_bool(d, v[BRIEF], "brief", &r->brief)))
        return rc;
    if (v[WARM_UPS] && (rc = read_bool(d, v[WARM_UPS], "warm_ups", &r->warm_ups)))
        return rc;
    return KM_OK;
}

/* One positional candidate row: [worker, depth, device_blocks, host_blocks, disk_blocks,
 * in_flight, pending_prefill_tokens, active_decode_blocks, cost, state, eligible]; nil means
 * absent (0, NAN for the cost, "no state", eligible); extra elements (a newer server) are
 * ignored. */
static int decode_candidate(km_protocol_decoder *d, const msgpack_object *o, uint32_t index,
                            km_candidate_score *c)
{
    static const char *const names[KM_CANDIDATE_ROW_FIELDS] = {
        "worker", "depth", "device_blocks", "host_blocks", "disk_blocks", "in_flight",
        "pending_prefill_tokens", "active_decode_blocks", "cost", "state", "eligible"};
    /* Errors name the candidate: "decisions[2].candidates[5].depth". */
    unsigned depth = d->path_depth;
    if (depth < 2) {
        d->path[depth].name = "candidates";
        d->path[depth].index = index;
        d->path_depth = depth + 1;
    }
    c->eligible = true;
    c->cost = NAN;
    int rc = KM_OK;
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size < KM_CANDIDATE_ROW_FIELDS) {
        rc = field_fail(d, KM_ERR_PARSE, NULL, NO_ELEMENT,
                        "expected an array of %u fields (a candidate row), got %s",
                        KM_CANDIDATE_ROW_FIELDS,
                        o->type == MSGPACK_OBJECT_ARRAY ? "fewer" : km_msgpack_type_name(o));
        d->path_depth = depth;
        return rc;
    }
    const msgpack_object *v = o->via.array.ptr;
#define ROW(i) (v[i].type == MSGPACK_OBJECT_NIL ? NULL : &v[i])
    if (!ROW(0))
        rc = missing(d, names[0]);
    if (rc || (rc = read_u32(d, &v[0], names[0], &c->worker)) ||
        (rc = OPT(read_u32(d, ROW(1), names[1], &c->depth), ROW(1))) ||
        (rc = OPT(read_u32(d, ROW(2), names[2], &c->device_blocks), ROW(2))) ||
        (rc = OPT(read_u32(d, ROW(3), names[3], &c->host_blocks), ROW(3))) ||
        (rc = OPT(read_u32(d, ROW(4), names[4], &c->disk_blocks), ROW(4))) ||
        (rc = OPT(read_u32(d, ROW(5), names[5], &c->load.in_flight), ROW(5))) ||
        (rc = OPT(read_u64(d, ROW(6), names[6], &c->load.pending_prefill_tokens), ROW(6))) ||
        (rc = OPT(read_u64(d, ROW(7), names[7], &c->load.active_decode_blocks), ROW(7))) ||
        (rc = OPT(read_double(d, ROW(8), names[8], &c->cost), ROW(8))) ||
        (rc = OPT(read_str(d, ROW(9), names[9], &c->state), ROW(9))) ||
        (rc = OPT(read_bool(d, ROW(10), names[10], &c->eligible), ROW(10)))) {
        d->path_depth = depth;
        return rc;
    }
#undef ROW
    d->path_depth = depth;
    return KM_OK;
}

static int read_source(km_protocol_decoder *d, const msgpack_object *o, km_prediction_source *out)
{
    const char *s;
    int rc = read_str(d, o, "source", &s);
    if (rc)
        return rc;
    *out = prediction_source_named(s, strlen(s));
    if (*out == KM_PREDICTION_NONE)
        return field_fail(d, KM_ERR_PARSE, "source", NO_ELEMENT,
                          "expected \"events\" or \"approx\", got \"%s\"", s);
    return KM_OK;
}

/* A decision's warm_up: {worker, blocks, tokens, decision_id, attempt_id}, each required. */
static int read_warm_up(km_protocol_decoder *d, const msgpack_object *o, km_route_decision *r)
{
    static const char *const names[] = {"worker", "blocks", "tokens", "decision_id",
                                        "attempt_id"};
    const msgpack_object *v[5];
    int rc = bind_fields(d, o, "warm_up", names, 5, v);
    if (rc)
        return rc;
    for (unsigned i = 0; i < 5; i++)
        if (!v[i]) {
            char field[32];
            snprintf(field, sizeof field, "warm_up.%s", names[i]);
            return missing(d, field);
        }
    uint64_t tokens = 0;
    if ((rc = read_u32(d, v[0], "warm_up.worker", &r->warm_up_worker)) ||
        (rc = read_u32(d, v[1], "warm_up.blocks", &r->warm_up_blocks)) ||
        (rc = read_u64(d, v[2], "warm_up.tokens", &tokens)) ||
        (rc = read_u64(d, v[3], "warm_up.decision_id", &r->warm_up_decision_id)) ||
        (rc = read_str(d, v[4], "warm_up.attempt_id", &r->warm_up_attempt_id)))
        return rc;
    r->warm_up_tokens = tokens;
    r->has_warm_up = true;
    return KM_OK;
}

static int decode_decision(km_protocol_decoder *d, const msgpack_object *o, km_route_decision *r)
{
    enum { STATUS, MESSAGE, REQUEST_ID, ATTEMPT_ID, DECISION_ID, POOL, CHOSEN_WORKER,
           CHOSEN_DEPTH, CHOSEN_STATE, OWNER_WORKER, OWNER_DEPTH, OWNER_STATE, N_BLOCKS,
           BLOCK_SIZE, SOURCE, POLICY, REASON, LOAD_KIND, LOAD_SCOPE, LOAD_VALUE, CANDIDATES,
           LOAD_INSTANCES, LOAD_OLDEST_AGE_MS, LOAD_STALE_INSTANCES, WARM_UP, N_FIELDS };
    static const char *const names[N_FIELDS] = {
        "status",      "message",      "request_id",   "attempt_id",   "decision_id",
        "pool",        "chosen_worker", "chosen_depth", "chosen_state", "owner_worker",
        "owner_depth", "owner_state",  "n_blocks",     "block_size",   "source",
        "policy",      "reason",       "load_kind",    "load_scope",   "load_value",
        "candidates",  "load_instances", "load_oldest_age_ms", "load_stale_instances",
        "warm_up"};
    const msgpack_object *v[N_FIELDS];
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc)
        return rc;
    int status = KM_OK;
    r->load_value = NAN; /* nil or absent: the policy weighed no load */
    r->load_oldest_age_ms = NAN;
    if ((rc = OPT(read_status(d, v[STATUS], "status", &status), v[STATUS])) ||
        (rc = OPT(read_str(d, v[REQUEST_ID], "request_id", &r->request_id), v[REQUEST_ID])) ||
        (rc = OPT(read_attempt_id(d, v[ATTEMPT_ID], &r->attempt_id), v[ATTEMPT_ID])))
        return rc;
    if (status != KM_OK) {
        r->status = status;
        if (v[MESSAGE] && (rc = read_str(d, v[MESSAGE], "message", &r->message)))
            return rc;
        if (!r->message)
            r->message = km_strerror(status);
        return KM_OK;
    }
    if (!v[DECISION_ID])
        return missing(d, "decision_id");
    if (!v[CHOSEN_WORKER])
        return missing(d, "chosen_worker");
    if (!v[SOURCE])
        return missing(d, "source");
    if ((rc = read_u64(d, v[DECISION_ID], "decision_id", &r->decision_id)) ||
        (rc = OPT(read_str(d, v[POOL], "pool", &r->pool), v[POOL])) ||
        (rc = read_u32(d, v[CHOSEN_WORKER], "chosen_worker", &r->chosen_worker)) ||
        (rc = OPT(read_u32(d, v[CHOSEN_DEPTH], "chosen_depth", &r->chosen_depth), v[CHOSEN_DEPTH])) ||
        (rc = OPT(read_str(d, v[CHOSEN_STATE], "chosen_state", &r->chosen_state),
                  v[CHOSEN_STATE])) ||
        (rc = OPT(read_u32(d, v[N_BLOCKS], "n_blocks", &r->n_blocks), v[N_BLOCKS])) ||
        (rc = OPT(read_u32(d, v[BLOCK_SIZE], "block_size", &r->block_size), v[BLOCK_SIZE])) ||
        (rc = read_source(d, v[SOURCE], &r->source)) ||
        (rc = OPT(read_str(d, v[POLICY], "policy", &r->policy), v[POLICY])) ||
        (rc = OPT(read_str(d, v[REASON], "reason", &r->reason), v[REASON])) ||
        (rc = OPT(read_str(d, v[LOAD_KIND], "load_kind", &r->load_kind), v[LOAD_KIND])) ||
        (rc = OPT(read_str(d, v[LOAD_SCOPE], "load_scope", &r->load_scope), v[LOAD_SCOPE])) ||
        (rc = OPT(read_double(d, v[LOAD_VALUE], "load_value", &r->load_value), v[LOAD_VALUE])) ||
        (rc = OPT(read_u32(d, v[LOAD_INSTANCES], "load_instances", &r->load_instances),
                  v[LOAD_INSTANCES])) ||
        (rc = OPT(read_double(d, v[LOAD_OLDEST_AGE_MS], "load_oldest_age_ms",
                              &r->load_oldest_age_ms), v[LOAD_OLDEST_AGE_MS])) ||
        (rc = OPT(read_str(d, v[LOAD_STALE_INSTANCES], "load_stale_instances",
                           &r->load_stale_instances), v[LOAD_STALE_INSTANCES])))
        return rc;
    if (v[OWNER_WORKER]) {
        r->has_owner = true;
        if ((rc = read_u32(d, v[OWNER_WORKER], "owner_worker", &r->owner_worker)) ||
            (rc = OPT(read_u32(d, v[OWNER_DEPTH], "owner_depth", &r->owner_depth),
                      v[OWNER_DEPTH])) ||
            (rc = OPT(read_str(d, v[OWNER_STATE], "owner_state", &r->owner_state),
                      v[OWNER_STATE])))
            return rc;
    }
    if (v[CANDIDATES]) {
        const msgpack_object *a = v[CANDIDATES];
        if ((rc = check_array_object(d, a, "candidates", d->limits.max_candidates,
                                     "max_candidates")))
            return rc;
        km_candidate_score *c = zone_array(d, a->via.array.size, sizeof *c);
        if (!c)
            return out_of_memory(d);
        for (uint32_t i = 0; i < a->via.array.size; i++)
            if ((rc = decode_candidate(d, &a->via.array.ptr[i], i, &c[i])))
                return rc;
        r->candidates = c;
        r->n_candidates = a->via.array.size;
    }
    if (v[WARM_UP] && (rc = read_warm_up(d, v[WARM_UP], r)))
        return rc;
    return KM_OK;
}

static const char *const lifecycle_names[] = {
    "event",         "decision_id", "request_id",    "attempt_id",  "worker",
    "elapsed_ms",    "outcome",     "finish_reason", "done_seen",   "http_status",
    "error",         "cached_tokens", "prompt_tokens", "output_tokens", "retries"};
enum { LC_EVENT, LC_DECISION_ID, LC_REQUEST_ID, LC_ATTEMPT_ID, LC_WORKER, LC_ELAPSED_MS,
       LC_OUTCOME, LC_FINISH_REASON, LC_DONE_SEEN, LC_HTTP_STATUS, LC_ERROR, LC_CACHED_TOKENS,
       LC_PROMPT_TOKENS, LC_OUTPUT_TOKENS, LC_RETRIES, LC_N_FIELDS };

static int read_optional_count(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                               bool *has, uint64_t *out)
{
    if (!o)
        return KM_OK;
    int rc = read_count(d, o, field, out);
    if (!rc)
        *has = true;
    return rc;
}

/* kind: the message type for the single-event forms, KM_LIFECYCLE_NONE when the "event" field
 * names it. */
static int decode_lifecycle_event(km_protocol_decoder *d, const msgpack_object *o,
                                  km_lifecycle_kind kind, km_lifecycle_event *e)
{
    const msgpack_object *v[LC_N_FIELDS];
    int rc = bind_fields(d, o, NULL, lifecycle_names, LC_N_FIELDS, v);
    if (rc)
        return rc;
    if ((rc = OPT(read_u64(d, v[LC_DECISION_ID], "decision_id", &e->decision_id),
                  v[LC_DECISION_ID])) ||
        (rc = OPT(read_str(d, v[LC_REQUEST_ID], "request_id", &e->request_id),
                  v[LC_REQUEST_ID])) ||
        (rc = OPT(read_attempt_id(d, v[LC_ATTEMPT_ID], &e->attempt_id), v[LC_ATTEMPT_ID])))
        return rc;
    e->has_decision_id = v[LC_DECISION_ID] != NULL;
    if (kind == KM_LIFECYCLE_NONE) {
        const char *name = NULL;
        if (!v[LC_EVENT])
            return missing(d, "event");
        if ((rc = read_str(d, v[LC_EVENT], "event", &name)))
            return rc;
        kind = lifecycle_kind_named(name, strlen(name));
        if (kind == KM_LIFECYCLE_NONE)
            return field_fail(d, KM_ERR_PARSE, "event", NO_ELEMENT,
                              "expected DISPATCHED, FIRST_TOKEN or FINISHED, got \"%s\"", name);
    }
    e->kind = kind;
    if (!e->has_decision_id && !(e->request_id && e->request_id[0]))
        return field_fail(d, KM_ERR_PARSE, "decision_id", NO_ELEMENT,
                          "required field is missing (an event names decision_id or request_id)");
    uint64_t x = 0;
    if (v[LC_WORKER]) {
        if ((rc = read_u32(d, v[LC_WORKER], "worker", &e->worker)))
            return rc;
        e->has_worker = true;
    }
    if (v[LC_ELAPSED_MS]) {
        if ((rc = read_double(d, v[LC_ELAPSED_MS], "elapsed_ms", &e->elapsed_ms)))
            return rc;
        if (!(e->elapsed_ms >= 0) || !isfinite(e->elapsed_ms))
            return field_fail(d, KM_ERR_INVALID_ARGUMENT, "elapsed_ms", NO_ELEMENT,
                              "must be a finite number of milliseconds >= 0, got %g", e->elapsed_ms);
        e->has_elapsed_ms = true;
    }
    if (kind != KM_LIFECYCLE_FINISHED)
        return KM_OK;
    const char *outcome = NULL;
    if ((rc = OPT(read_str(d, v[LC_OUTCOME], "outcome", &outcome), v[LC_OUTCOME])) ||
        (rc = OPT(read_str(d, v[LC_FINISH_REASON], "finish_reason", &e->finish_reason),
                  v[LC_FINISH_REASON])) ||
        (rc = OPT(read_bool(d, v[LC_DONE_SEEN], "done_seen", &e->done_seen), v[LC_DONE_SEEN])) ||
        (rc = OPT(read_str(d, v[LC_ERROR], "error", &e->error), v[LC_ERROR])) ||
        (rc = read_optional_count(d, v[LC_CACHED_TOKENS], "cached_tokens",
                                  &e->has_cached_tokens, &e->cached_tokens)) ||
        (rc = read_optional_count(d, v[LC_PROMPT_TOKENS], "prompt_tokens",
                                  &e->has_prompt_tokens, &e->prompt_tokens)) ||
        (rc = read_optional_count(d, v[LC_OUTPUT_TOKENS], "output_tokens",
                                  &e->has_output_tokens, &e->output_tokens)) ||
        (rc = OPT(read_u32(d, v[LC_RETRIES], "retries", &e->retries), v[LC_RETRIES])))
        return rc;
    if (v[LC_HTTP_STATUS]) {
        if ((rc = read_u64_element(d, v[LC_HTTP_STATUS], "http_status", NO_ELEMENT, 999, &x)))
            return rc;
        e->has_http_status = true;
        e->http_status = (uint32_t)x;
    }
    km_outcome derived = km_outcome_from_stream(e->finish_reason, e->done_seen, e->has_http_status,
                                                e->http_status, e->error);
    if (!outcome) {
        e->outcome = derived;
        return KM_OK;
    }
    km_outcome sent = outcome_named(outcome, strlen(outcome));
    if (sent == KM_OUTCOME_NONE)
        return field_fail(d, KM_ERR_PARSE, "outcome", NO_ELEMENT,
                          "expected complete, incomplete, error or cancelled, got \"%s\"",
                          outcome);
    if (sent == KM_OUTCOME_COMPLETE && derived != KM_OUTCOME_COMPLETE)
        return field_fail(d, KM_ERR_INVALID_ARGUMENT, "outcome", NO_ELEMENT,
                          "\"complete\" needs a final finish_reason, done_seen true, no error "
                          "and a 2xx http_status (the stream says %s)",
                          km_outcome_name(derived));
    e->outcome = sent;
    return KM_OK;
}

static int decode_worker(km_protocol_decoder *d, const msgpack_object *o, km_worker_info *w)
{
    enum { POOL, WORKER, NAME, EVENT_ENDPOINT, REPLAY_ENDPOINT, DP_RANK, STATE, BLOCKS,
           LAST_EVENT_AGE_S, LOAD, EXPECTED_SEQ, HEALTHY, BREAKER, FAILURES, ELIGIBLE, N_FIELDS };
    static const char *const names[N_FIELDS] = {
        "pool",    "worker",  "name",    "event_endpoint",   "replay_endpoint",
        "dp_rank", "state",   "blocks",  "last_event_age_s", "load",
        "expected_seq", "healthy", "breaker", "failures", "eligible"};
    const msgpack_object *v[N_FIELDS];
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc)
        return rc;
    if ((rc = read_nonempty_str(d, v[POOL], "pool", &w->pool)))
        return rc;
    if (!v[WORKER])
        return missing(d, "worker");
    if ((rc = read_u32(d, v[WORKER], "worker", &w->worker)) ||
        (rc = OPT(read_str(d, v[NAME], "name", &w->name), v[NAME])) ||
        (rc = OPT(read_str(d, v[EVENT_ENDPOINT], "event_endpoint", &w->event_endpoint),
                  v[EVENT_ENDPOINT])) ||
        (rc = OPT(read_str(d, v[REPLAY_ENDPOINT], "replay_endpoint", &w->replay_endpoint),
                  v[REPLAY_ENDPOINT])) ||
        (rc = OPT(read_str(d, v[STATE], "state", &w->state), v[STATE])) ||
        (rc = OPT(read_str(d, v[BREAKER], "breaker", &w->breaker), v[BREAKER])) ||
        (rc = read_optional_count(d, v[BLOCKS], "blocks", &w->has_blocks, &w->blocks)))
        return rc;
    if ((rc = OPT_HAS(read_bool(d, v[HEALTHY], "healthy", &w->healthy), v[HEALTHY],
                      &w->has_healthy)) ||
        (rc = OPT_HAS(read_u32(d, v[FAILURES], "failures", &w->failures), v[FAILURES],
                      &w->has_failures)) ||
        (rc = OPT_HAS(read_bool(d, v[ELIGIBLE], "eligible", &w->eligible), v[ELIGIBLE],
                      &w->has_eligible)) ||
        (rc = OPT_HAS(read_u32(d, v[DP_RANK], "dp_rank", &w->dp_rank), v[DP_RANK],
                      &w->has_dp_rank)) ||
        (rc = OPT_HAS(read_u64(d, v[EXPECTED_SEQ], "expected_seq", &w->expected_seq),
                      v[EXPECTED_SEQ], &w->has_expected_seq)) ||
        (rc = OPT_HAS(read_double(d, v[LAST_EVENT_AGE_S], "last_event_age_s",
                                  &w->last_event_age_s),
                      v[LAST_EVENT_AGE_S], &w->has_last_event_age_s)) ||
        (rc = OPT_HAS(read_load(d, v[LOAD], &w->load), v[LOAD], &w->has_load)))
        return rc;
    return KM_OK;
}

static int decode_pool(km_protocol_decoder *d, const msgpack_object *o, km_pool_info *p)
{
    enum { NAME, MODEL, BLOCK_SIZE, LOOKAHEAD, POLICY, PARAMS, CHUNK, ENGINE, N_FIELDS };
    static const char *const names[N_FIELDS] = {"name",   "model",  "block_size",
                                                "hash_lookahead_tokens", "policy", "params",
                                                "offload_chunk_blocks", "engine"};
    const msgpack_object *v[N_FIELDS];
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc)
        return rc;
    if ((rc = read_nonempty_str(d, v[NAME], "name", &p->name)) ||
        (rc = OPT(read_str(d, v[MODEL], "model", &p->model), v[MODEL])) ||
        (rc = OPT(read_u32(d, v[BLOCK_SIZE], "block_size", &p->block_size), v[BLOCK_SIZE])) ||
        (rc = OPT(read_u32(d, v[LOOKAHEAD], "hash_lookahead_tokens", &p->hash_lookahead_tokens),
                  v[LOOKAHEAD])) ||
        (rc = OPT(read_str(d, v[POLICY], "policy", &p->policy), v[POLICY])) ||
        (rc = OPT(read_str(d, v[ENGINE], "engine", &p->engine), v[ENGINE])) ||
        (rc = OPT(read_u32(d, v[CHUNK], "offload_chunk_blocks", &p->offload_chunk_blocks),
                  v[CHUNK])))
        return rc;
    if (v[BLOCK_SIZE] && p->block_size == 0)
        return field_fail(d, KM_ERR_PARSE, "block_size", NO_ELEMENT, "must be at least 1");
    if (p->hash_lookahead_tokens > KM_HASH_MAX_LOOKAHEAD)
        return field_fail(d, KM_ERR_PARSE, "hash_lookahead_tokens", NO_ELEMENT, "%u is over %u",
                          p->hash_lookahead_tokens, KM_HASH_MAX_LOOKAHEAD);
    if (v[CHUNK] && (p->offload_chunk_blocks == 0 ||
                     p->offload_chunk_blocks > KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS))
        return field_fail(d, KM_ERR_PARSE, "offload_chunk_blocks", NO_ELEMENT,
                          "%u is outside 1 to %u", p->offload_chunk_blocks,
                          KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS);
    if (v[PARAMS]) {
        const msgpack_object *m = v[PARAMS];
        if (m->type != MSGPACK_OBJECT_MAP)
            return field_fail(d, KM_ERR_PARSE, "params", NO_ELEMENT,
                              "expected a map of name -> number, got %s", km_msgpack_type_name(m));
        if (m->via.map.size > d->limits.max_params)
            return field_fail(d, KM_ERR_TOO_LARGE, "params", NO_ELEMENT,
                              "%u entries, max_params is %u", m->via.map.size,
                              d->limits.max_params);
        km_param *params = zone_array(d, m->via.map.size, sizeof *params);
        if (!params)
            return out_of_memory(d);
        for (uint32_t i = 0; i < m->via.map.size; i++) {
            const msgpack_object *key = &m->via.map.ptr[i].key;
            if (key->type != MSGPACK_OBJECT_STR || key->via.str.size == 0)
                return field_fail(d, KM_ERR_PARSE, "params", i,
                                  "a parameter name must be a non-empty str, got %s",
                                  km_msgpack_type_name(key));
            if ((rc = read_str(d, key, "params", &params[i].name)) ||
                (rc = read_double(d, &m->via.map.ptr[i].val, params[i].name, &params[i].value)))
                return rc;
            for (uint32_t j = 0; j < i; j++)
                if (strcmp(params[j].name, params[i].name) == 0)
                    return field_fail(d, KM_ERR_PARSE, "params", i,
                                      "parameter \"%s\" appears twice", params[i].name);
        }
        p->params = params;
        p->n_params = m->via.map.size;
    }
    return KM_OK;
}

/* ---- stage 3: batches and messages ----------------------------------------------------------- */

typedef int (*item_decoder)(km_protocol_decoder *d, const msgpack_object *o, void *item);

static int route_item(km_protocol_decoder *d, const msgpack_object *o, void *item)
{
    return decode_route(d, o, item);
}
static int decision_item(km_protocol_decoder *d, const msgpack_object *o, void *item)
{
    return decode_decision(d, o, item);
}
static int lifecycle_item(km_protocol_decoder *d, const msgpack_object *o, void *item)
{
    return decode_lifecycle_event(d, o, KM_LIFECYCLE_NONE, item);
}
static int worker_item(km_protocol_decoder *d, const msgpack_object *o, void *item)
{
    return decode_worker(d, o, item);
}
static int pool_item(km_protocol_decoder *d, const msgpack_object *o, void *item)
{
    return decode_pool(d, o, item);
}

/* Every item struct begins with `int status; const char *message;`. */
typedef struct item_head {
    int status;
    const char *message;
} item_head;

/* A batch array: the array itself must be valid (else the message fails); each item that fails
 * gets its status and message, and the rest go on. min_items: 1 for request batches. */
static int decode_items(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                        uint32_t min_items, size_t item_size, item_decoder decode_one,
                        void **items_out, uint32_t *n_out)
{
    if (!o)
        return missing(d, field);
    int rc = check_array_object(d, o, field, d->limits.max_batch_items, "max_batch_items");
    if (rc)
        return rc;
    uint32_t n = o->via.array.size;
    if (n < min_items)
        return field_fail(d, KM_ERR_PARSE, field, NO_ELEMENT, "needs at least %u entries",
                          min_items);
    unsigned char *items = zone_array(d, n, item_size);
    if (!items)
        return out_of_memory(d);
    for (uint32_t i = 0; i < n; i++) {
        item_head *head = (item_head *)(items + i * item_size);
        d->path[0].name = field;
        d->path[0].index = i;
        d->path_depth = 1;
        rc = decode_one(d, &o->via.array.ptr[i], head);
        d->path_depth = 0;
        if (rc == KM_ERR_OUT_OF_MEMORY)
            return rc;
        if (rc) {
            head->status = rc;
            if (copy_string(d, d->error, strlen(d->error), &head->message))
                return out_of_memory(d);
        }
    }
    *items_out = items;
    *n_out = n;
    return KM_OK;
}

static int decode_limits(km_protocol_decoder *d, const msgpack_object *o, km_protocol_limits *l)
{
    static const char *const names[] = {"max_frame_bytes",      "max_objects",
                                        "max_batch_items",      "max_tokens_per_route",
                                        "max_hashes_per_route", "max_candidates",
                                        "max_params",           "max_string_bytes"};
    uint32_t *fields[] = {&l->max_frame_bytes,      &l->max_objects,    &l->max_batch_items,
                          &l->max_tokens_per_route, &l->max_hashes_per_route,
                          &l->max_candidates,       &l->max_params,     &l->max_string_bytes};
    const msgpack_object *v[8];
    int rc = bind_fields(d, o, "limits", names, 8, v);
    for (unsigned i = 0; !rc && i < 8; i++) {
        if (!v[i])
            continue;
        rc = read_u32(d, v[i], names[i], fields[i]);
        if (!rc && *fields[i] == 0)
            rc = field_fail(d, KM_ERR_PARSE, names[i], NO_ELEMENT, "must be at least 1");
    }
    return rc;
}

static int read_action(km_protocol_decoder *d, const msgpack_object *o, km_admin_action *out)
{
    const char *s;
    if (!o)
        return missing(d, "action");
    int rc = read_str(d, o, "action", &s);
    if (rc)
        return rc;
    *out = admin_action_named(s, strlen(s));
    if (*out == KM_ADMIN_NONE)
        return field_fail(d, KM_ERR_PARSE, "action", NO_ELEMENT,
                          "expected add, remove, update or list, got \"%s\"", s);
    return KM_OK;
}

static int decode_body(km_protocol_decoder *d, const msgpack_object *root, km_message *m)
{
    /* One bind per type; names that a type does not use are simply not listed. */
    const msgpack_object *v[MAX_FIELDS];
    int rc;
    switch (m->type) {
    case KM_MESSAGE_HELLO: {
        static const char *const names[] = {"protocol", "client"};
        if ((rc = bind_fields(d, root, NULL, names, 2, v)))
            return rc;
        if (!v[0])
            return missing(d, "protocol");
        if ((rc = read_u32(d, v[0], "protocol", &m->hello.protocol_version)) ||
            (rc = OPT(read_str(d, v[1], "client", &m->hello.client_name), v[1])))
            return rc;
        return KM_OK;
    }
    case KM_MESSAGE_WELCOME: {
        static const char *const names[] = {"protocol", "kvmatch_version", "server", "limits"};
        if ((rc = bind_fields(d, root, NULL, names, 4, v)))
            return rc;
        km_protocol_limits_init(&m->welcome.limits);
        if (!v[0])
            return missing(d, "protocol");
        if ((rc = read_u32(d, v[0], "protocol", &m->welcome.protocol_version)) ||
            (rc = read_nonempty_str(d, v[1], "kvmatch_version", &m->welcome.kvmatch_version)) ||
            (rc = OPT(read_str(d, v[2], "server", &m->welcome.server_name), v[2])) ||
            (rc = OPT(decode_limits(d, v[3], &m->welcome.limits), v[3])))
            return rc;
        return KM_OK;
    }
    case KM_MESSAGE_ROUTE: {
        static const char *const names[] = {"routes"};
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 1, v)) ||
            (rc = decode_items(d, v[0], "routes", 1, sizeof(km_route_request), route_item,
                               &items, &m->route.n_routes)))
            return rc;
        m->route.routes = items;
        return KM_OK;
    }
    case KM_MESSAGE_DECISION: {
        static const char *const names[] = {"kvmatch_version", "decisions"};
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 2, v)) ||
            (rc = OPT(read_str(d, v[0], "kvmatch_version", &m->decision.kvmatch_version), v[0])) ||
            (rc = decode_items(d, v[1], "decisions", 0, sizeof(km_route_decision), decision_item,
                               &items, &m->decision.n_decisions)))
            return rc;
        m->decision.decisions = items;
        return KM_OK;
    }
    case KM_MESSAGE_LIFECYCLE: {
        static const char *const names[] = {"events"};
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 1, v)) ||
            (rc = decode_items(d, v[0], "events", 1, sizeof(km_lifecycle_event), lifecycle_item,
                               &items, &m->lifecycle.n_events)))
            return rc;
        m->lifecycle.events = items;
        return KM_OK;
    }
    case KM_MESSAGE_ACK: {
        static const char *const names[] = {"items"};
        if ((rc = bind_fields(d, root, NULL, names, 1, v)))
            return rc;
        if (!v[0])
            return missing(d, "items");
        if ((rc = check_array_object(d, v[0], "items", d->limits.max_batch_items,
                                     "max_batch_items")))
            return rc;
        uint32_t n = v[0]->via.array.size;
        km_item_status *items = zone_array(d, n, sizeof *items);
        if (!items)
            return out_of_memory(d);
        for (uint32_t i = 0; i < n; i++) {
            static const char *const item_names[] = {"status", "message"};
            const msgpack_object *iv[2];
            d->path[0].name = "items";
            d->path[0].index = i;
            d->path_depth = 1;
            if ((rc = bind_fields(d, &v[0]->via.array.ptr[i], NULL, item_names, 2, iv)))
                return rc;
            if (!iv[0])
                return missing(d, "status");
            if ((rc = read_status(d, iv[0], "status", &items[i].status)) ||
                (rc = OPT(read_str(d, iv[1], "message", &items[i].message), iv[1])))
                return rc;
            if (items[i].status == KM_OK)
                items[i].message = NULL;
            else if (!items[i].message)
                items[i].message = km_strerror(items[i].status);
        }
        d->path_depth = 0;
        m->ack.items = items;
        m->ack.n_items = n;
        return KM_OK;
    }
    case KM_MESSAGE_WORKERS:
    case KM_MESSAGE_WORKER_LIST: {
        static const char *const names[] = {"action", "pool", "workers"};
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 3, v)))
            return rc;
        if (m->type == KM_MESSAGE_WORKER_LIST) {
            m->workers.action = KM_ADMIN_LIST;
        } else {
            if ((rc = read_action(d, v[0], &m->workers.action)))
                return rc;
            if (m->workers.action == KM_ADMIN_LIST)
                return OPT(read_str(d, v[1], "pool", &m->workers.pool), v[1]);
        }
        if ((rc = decode_items(d, v[2], "workers", m->type == KM_MESSAGE_WORKERS ? 1 : 0,
                               sizeof(km_worker_info), worker_item, &items,
                               &m->workers.n_workers)))
            return rc;
        m->workers.workers = items;
        return KM_OK;
    }
    case KM_MESSAGE_POOLS:
    case KM_MESSAGE_POOL_LIST: {
        static const char *const names[] = {"action", "pools"};
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 2, v)))
            return rc;
        if (m->type == KM_MESSAGE_POOL_LIST) {
            m->pools.action = KM_ADMIN_LIST;
        } else {
            if ((rc = read_action(d, v[0], &m->pools.action)))
                return rc;
            if (m->pools.action == KM_ADMIN_LIST)
                return KM_OK;
        }
        if ((rc = decode_items(d, v[1], "pools", m->type == KM_MESSAGE_POOLS ? 1 : 0,
                               sizeof(km_pool_info), pool_item, &items, &m->pools.n_pools)))
            return rc;
        m->pools.pools = items;
        return KM_OK;
    }
    case KM_MESSAGE_STATUS:
        return KM_OK;
    case KM_MESSAGE_STATUS_REPLY: {
        static const char *const names[] = {"kvmatch_version", "uptime_s", "ready", "connections",
                                            "decisions", "records_dropped", "backend", "workers"};
        km_status_reply *s = &m->status_reply;
        void *items = NULL;
        if ((rc = bind_fields(d, root, NULL, names, 8, v)) ||
            (rc = read_nonempty_str(d, v[0], "kvmatch_version", &s->kvmatch_version)) ||
            (rc = OPT(read_double(d, v[1], "uptime_s", &s->uptime_s), v[1])) ||
            (rc = OPT(read_bool(d, v[2], "ready", &s->ready), v[2])) ||
            (rc = OPT(read_u32(d, v[3], "connections", &s->connections), v[3])) ||
            (rc = OPT(read_u64(d, v[4], "decisions", &s->decisions), v[4])) ||
            (rc = OPT(read_u64(d, v[5], "records_dropped", &s->records_dropped), v[5])) ||
            (rc = OPT(read_str(d, v[6], "backend", &s->backend), v[6])))
            return rc;
        if (v[7]) {
            if ((rc = decode_items(d, v[7], "workers", 0, sizeof(km_worker_info), worker_item,
                                   &items, &s->n_workers)))
                return rc;
            s->workers = items;
        }
        return KM_OK;
    }
    case KM_MESSAGE_ERROR: {
        static const char *const names[] = {"code", "name", "message"};
        if ((rc = bind_fields(d, root, NULL, names, 3, v)))
            return rc;
        if (!v[0])
            return missing(d, "code");
        if ((rc = read_status(d, v[0], "code", &m->error.code)))
            return rc;
        if (m->error.code == KM_OK)
            return field_fail(d, KM_ERR_PARSE, "code", NO_ELEMENT, "an ERROR code is negative");
        if ((rc = OPT(read_str(d, v[1], "name", &m->error.name), v[1])) ||
            (rc = OPT(read_str(d, v[2], "message", &m->error.message), v[2])))
            return rc;
        if (!m->error.name)
            m->error.name = km_error_name(m->error.code);
        if (!m->error.message)
            m->error.message = "";
        return KM_OK;
    }
    case KM_MESSAGE_UNKNOWN:
        break;
    }
    return field_fail(d, KM_ERR_INTERNAL, NULL, NO_ELEMENT, "no decoder for type %d",
                      (int)m->type);
}

static int decode_message(km_protocol_decoder *d, const uint8_t *p, size_t size, km_message *m)
{
    int rc = prescan(d, p, size);
    if (rc)
        return rc;
    msgpack_object root;
    size_t offset = 0;
    msgpack_unpack_return ur = msgpack_unpack((const char *)p, size, &offset, &d->zone, &root);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR)
        return out_of_memory(d);
    if (ur != MSGPACK_UNPACK_SUCCESS)
        return field_fail(d, KM_ERR_PARSE, NULL, NO_ELEMENT, "msgpack-c rejected the payload (%d)",
                          (int)ur);
    if (root.type != MSGPACK_OBJECT_MAP)
        return field_fail(d, KM_ERR_PARSE, NULL, NO_ELEMENT, "a message is a map, got %s",
                          km_msgpack_type_name(&root));
    static const char *const head_names[] = {"type", "id"};
    const msgpack_object *head[2];
    int bound = bind_fields(d, &root, NULL, head_names, 2, head);
    /* The type and the id are kept as far as they read, also when the map failed (a key twice)
     * or has no id: the server's ERROR then carries the id, and a HELLO that failed is one. */
    km_lifecycle_kind single = KM_LIFECYCLE_NONE; /* type DISPATCHED / FIRST_TOKEN / FINISHED */
    km_message_type type = KM_MESSAGE_UNKNOWN;
    if (head[0] && head[0]->type == MSGPACK_OBJECT_STR) {
        single = lifecycle_kind_named(head[0]->via.str.ptr, head[0]->via.str.size);
        type = single != KM_LIFECYCLE_NONE
                   ? KM_MESSAGE_LIFECYCLE
                   : message_type_named(head[0]->via.str.ptr, head[0]->via.str.size);
        m->type = type;
    }
    if (head[1] && head[1]->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        m->id = head[1]->via.u64;
        m->has_id = true;
    }
    if (bound)
        return bound;
    if (head[1] && !m->has_id)
        return read_u64(d, head[1], "id", &m->id);
    if (!head[0])
        return missing(d, "type");
    if (head[0]->type != MSGPACK_OBJECT_STR)
        return field_fail(d, KM_ERR_PARSE, "type", NO_ELEMENT, "expected a str, got %s",
                          km_msgpack_type_name(head[0]));
    if (!m->has_id)
        return missing(d, "id");
    if (single != KM_LIFECYCLE_NONE) {
        km_lifecycle_event *e = zone_array(d, 1, sizeof *e);
        if (!e)
            return out_of_memory(d);
        /* The event's fields are the message's: an error names them as they are, no "events[0]" */
        d->path_depth = 0;
        rc = decode_lifecycle_event(d, &root, single, e);
        d->path_depth = 0;
        if (rc == KM_ERR_OUT_OF_MEMORY)
            return rc;
        if (rc) {
            e->status = rc;
            if (copy_string(d, d->error, strlen(d->error), &e->message))
                return out_of_memory(d);
        }
        m->lifecycle.events = e;
        m->lifecycle.n_events = 1;
        return KM_OK;
    }
    if (type != KM_MESSAGE_UNKNOWN)
        return decode_body(d, &root, m);
    int shown = head[0]->via.str.size > 64 ? 64 : (int)head[0]->via.str.size;
    return field_fail(d, KM_ERR_PROTOCOL, "type", NO_ELEMENT, "unknown message type \"%.*s\"",
                      shown, head[0]->via.str.ptr);
}

int km_protocol_decode(km_protocol_decoder *d, const void *payload, size_t payload_size,
                       km_message *out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    memset(out, 0, sizeof *out);
    if (!d)
        return KM_ERR_NULL_POINTER;
    d->last_error[0] = 0;
    d->path_depth = 0;
    if (!payload && payload_size)
        return KM_ERR_NULL_POINTER;
    msgpack_zone_clear(&d->zone);
    int rc;
    if (payload_size == 0)
        rc = field_fail(d, KM_ERR_PARSE, NULL, NO_ELEMENT, "empty payload");
    else if (payload_size > d->limits.max_frame_bytes)
        rc = field_fail(d, KM_ERR_TOO_LARGE, NULL, NO_ELEMENT,
                        "payload of %zu bytes, max_frame_bytes is %u", payload_size,
                        d->limits.max_frame_bytes);
    else
        rc = decode_message(d, payload, payload_size, out);
    if (rc) {
        memcpy(d->last_error, d->error, sizeof d->last_error);
        /* Keep what identifies the message; the body is partial and cleared. */
        km_message_type type = out->type;
        bool has_id = out->has_id;
        uint64_t id = out->id;
        memset(out, 0, sizeof *out);
        out->type = type;
        out->has_id = has_id;
        out->id = id;
    }
    return rc;
}
