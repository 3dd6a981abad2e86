/* The routing service's wire protocol (include/kvmatch/protocol.h, docs/PROTOCOL.md): the frame
 * reader, the encoder and the decoder.
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

#include "kvmatch/protocol.h"
#include "base/error_detail.h"
#include "base/msgpack_scan.h"

#if defined(__GNUC__)
#define KM_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define KM_PRINTF(fmt_index, first_arg)
#endif

#define ERROR_BYTES          512
#define READER_KEEP_BYTES    ((size_t)64 << 10) /* buffer kept between frames */
#define READER_MIN_BYTES     ((size_t)4 << 10)
#define ZONE_CHUNK_BYTES     ((size_t)64 << 10)
#define NO_ELEMENT           UINT64_MAX

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

static bool limits_valid(const km_protocol_limits *l)
{
    return l->max_frame_bytes && l->max_objects && l->max_batch_items && l->max_tokens_per_route &&
           l->max_hashes_per_route && l->max_candidates && l->max_params && l->max_string_bytes;
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

/* ---- frame reader ---------------------------------------------------------------------------- */

struct km_frame_reader {
    uint32_t max_frame_bytes;
    uint8_t header[KM_FRAME_HEADER_BYTES];
    unsigned header_have; /* bytes of the length prefix read so far */
    uint32_t frame_bytes; /* declared payload length, once the prefix is complete */
    uint8_t *buffer;      /* payload being assembled */
    size_t buffer_have;
    size_t buffer_capacity;
    bool release_buffer; /* the last frame handed out was large: free its buffer next call */
    int failed;          /* sticky status, KM_OK while healthy */
    char last_error[ERROR_BYTES];
};

int km_frame_reader_create(uint32_t max_frame_bytes, km_frame_reader **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_frame_reader *r = calloc(1, sizeof *r);
    if (!r)
        return KM_ERR_OUT_OF_MEMORY;
    r->max_frame_bytes = max_frame_bytes ? max_frame_bytes : KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES;
    *out = r;
    return KM_OK;
}

void km_frame_reader_destroy(km_frame_reader *r)
{
    if (!r)
        return;
    free(r->buffer);
    free(r);
}

size_t km_frame_reader_pending(const km_frame_reader *r)
{
    return r ? r->header_have + r->buffer_have : 0;
}

bool km_frame_reader_failed(const km_frame_reader *r)
{
    return r && r->failed != KM_OK;
}

const char *km_frame_reader_last_error(const km_frame_reader *r)
{
    return r ? r->last_error : "";
}

KM_PRINTF(3, 4) static int reader_fail(km_frame_reader *r, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(r->last_error, sizeof r->last_error, status, fmt, ap);
    va_end(ap);
    r->failed = status;
    return status;
}

/* Make room for `needed` payload bytes, doubling (so a hostile length costs only what arrives). */
static int reader_reserve(km_frame_reader *r, size_t needed)
{
    if (r->buffer_capacity >= needed)
        return KM_OK;
    size_t capacity = r->buffer_capacity ? r->buffer_capacity : READER_MIN_BYTES;
    while (capacity < needed)
        capacity *= 2;
    if (capacity > r->frame_bytes)
        capacity = r->frame_bytes;
    uint8_t *grown = realloc(r->buffer, capacity);
    if (!grown)
        return reader_fail(r, KM_ERR_OUT_OF_MEMORY, "cannot grow the frame buffer to %zu bytes",
                           capacity);
    r->buffer = grown;
    r->buffer_capacity = capacity;
    return KM_OK;
}

void km_frame_reader_release(km_frame_reader *r)
{
    if (!r || !r->release_buffer)
        return;
    free(r->buffer);
    r->buffer = NULL;
    r->buffer_capacity = 0;
    r->release_buffer = false;
}

int km_frame_reader_next(km_frame_reader *r, const void *data, size_t size, size_t *consumed,
                         const uint8_t **payload, size_t *payload_size)
{
    if (!r || !consumed || !payload || !payload_size)
        return KM_ERR_NULL_POINTER;
    *consumed = 0;
    *payload = NULL;
    *payload_size = 0;
    if (r->failed)
        return r->failed;
    if (!data && size)
        return KM_ERR_NULL_POINTER;
    km_frame_reader_release(r);
    const uint8_t *p = data;
    size_t used = 0;
    while (r->header_have < KM_FRAME_HEADER_BYTES && used < size)
        r->header[r->header_have++] = p[used++];
    if (r->header_have < KM_FRAME_HEADER_BYTES) {
        *consumed = used;
        return KM_OK;
    }
    if (r->buffer_have == 0 && r->frame_bytes == 0) {
        uint32_t length = (uint32_t)r->header[0] << 24 | (uint32_t)r->header[1] << 16 |
                          (uint32_t)r->header[2] << 8 | r->header[3];
        if (length == 0)
            return reader_fail(r, KM_ERR_PROTOCOL,
                               "frame of length 0 (a frame holds one msgpack map)");
        if (length > r->max_frame_bytes)
            return reader_fail(r, KM_ERR_TOO_LARGE,
                               "frame declares %" PRIu32 " payload bytes, max_frame_bytes is %" PRIu32,
                               length, r->max_frame_bytes);
        r->frame_bytes = length;
        /* Whole frame in this chunk and nothing buffered: hand it out in place. */
        if (size - used >= length) {
            *payload = p + used;
            *payload_size = length;
            *consumed = used + length;
            r->header_have = 0;
            r->frame_bytes = 0;
            return KM_OK;
        }
    }
    size_t want = r->frame_bytes - r->buffer_have;
    size_t take = size - used < want ? size - used : want;
    if (take) {
        int rc = reader_reserve(r, r->buffer_have + take);
        if (rc)
            return rc;
        memcpy(r->buffer + r->buffer_have, p + used, take);
        r->buffer_have += take;
        used += take;
    }
    *consumed = used;
    if (r->buffer_have == r->frame_bytes) {
        *payload = r->buffer;
        *payload_size = r->buffer_have;
        r->release_buffer = r->buffer_capacity > READER_KEEP_BYTES;
        r->header_have = 0;
        r->frame_bytes = 0;
        r->buffer_have = 0;
    }
    return KM_OK;
}

/* ---- frame buffer and encoder ---------------------------------------------------------------- */

void km_frame_buffer_init(km_frame_buffer *b)
{
    if (b)
        memset(b, 0, sizeof *b);
}

void km_frame_buffer_free(km_frame_buffer *b)
{
    if (!b)
        return;
    free(b->data);
    memset(b, 0, sizeof *b);
}

void km_frame_buffer_consume(km_frame_buffer *b, size_t n)
{
    if (!b)
        return;
    if (n >= b->size) {
        b->size = 0;
        return;
    }
    memmove(b->data, b->data + n, b->size - n);
    b->size -= n;
}

typedef struct writer {
    km_frame_buffer *buffer;
    msgpack_packer packer;
    int status; /* first failure */
    char *why;
    size_t why_size;
} writer;

typedef struct map_mark {
    size_t offset; /* of the map16 header */
    uint32_t count;
} map_mark;

static int buffer_append(void *data, const char *bytes, size_t n)
{
    writer *w = data;
    km_frame_buffer *b = w->buffer;
    if (w->status)
        return -1;
    if (b->capacity - b->size < n) {
        size_t capacity = b->capacity ? b->capacity : 256;
        while (capacity - b->size < n) {
            if (capacity > SIZE_MAX / 2) {
                w->status = KM_ERR_OUT_OF_MEMORY;
                return -1;
            }
            capacity *= 2;
        }
        uint8_t *grown = realloc(b->data, capacity);
        if (!grown) {
            w->status = KM_ERR_OUT_OF_MEMORY;
            return -1;
        }
        b->data = grown;
        b->capacity = capacity;
    }
    /* msgpack-c hands over one value at a time (1, 2, 3, 5 or 9 bytes for scalars and headers):
     * constant-size copies for those instead of a call to memcpy per value. */
    uint8_t *dst = b->data + b->size;
    switch (n) {
    case 1: dst[0] = (uint8_t)bytes[0]; break;
    case 2: memcpy(dst, bytes, 2); break;
    case 3: memcpy(dst, bytes, 3); break;
    case 5: memcpy(dst, bytes, 5); break;
    case 9: memcpy(dst, bytes, 9); break;
    default: memcpy(dst, bytes, n); break;
    }
    b->size += n;
    return 0;
}

KM_PRINTF(3, 4) static void writer_fail(writer *w, int status, const char *fmt, ...)
{
    if (w->status)
        return;
    w->status = status;
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(w->why, w->why_size, status, fmt, ap);
    va_end(ap);
}

/* Maps are written with a map16 header patched at the end, so optional fields need no count
 * up front (msgpack allows a non-minimal length encoding). */
static void map_begin(writer *w, map_mark *m)
{
    static const char header[3] = {(char)0xde, 0, 0};
    m->offset = w->buffer->size;
    m->count = 0;
    buffer_append(w, header, sizeof header);
}

static void map_end(writer *w, map_mark *m)
{
    if (w->status)
        return;
    if (m->count > 0xffff) {
        writer_fail(w, KM_ERR_INTERNAL, "map with %u fields", m->count);
        return;
    }
    w->buffer->data[m->offset + 1] = (uint8_t)(m->count >> 8);
    w->buffer->data[m->offset + 2] = (uint8_t)m->count;
}

static void put_key(writer *w, map_mark *m, const char *key)
{
    msgpack_pack_str_with_body(&w->packer, key, strlen(key));
    m->count++;
}

static void pack_cstr(writer *w, const char *s)
{
    msgpack_pack_str_with_body(&w->packer, s, strlen(s));
}

static void put_u64(writer *w, map_mark *m, const char *key, uint64_t v)
{
    put_key(w, m, key);
    msgpack_pack_uint64(&w->packer, v);
}

static void put_i64(writer *w, map_mark *m, const char *key, int64_t v)
{
    put_key(w, m, key);
    msgpack_pack_int64(&w->packer, v);
}

static void put_double(writer *w, map_mark *m, const char *key, double v)
{
    put_key(w, m, key);
    msgpack_pack_double(&w->packer, v);
}

/* A real that may be missing: NAN (or another value that is not finite) goes out as nil, which
 * every msgpack reader takes; a NaN float would reach clients whose JSON cannot hold it. */
static void put_double_or_nil(writer *w, map_mark *m, const char *key, double v)
{
    put_key(w, m, key);
    if (isfinite(v))
        msgpack_pack_double(&w->packer, v);
    else
        msgpack_pack_nil(&w->packer);
}

static void put_bool(writer *w, map_mark *m, const char *key, bool v)
{
    put_key(w, m, key);
    if (v)
        msgpack_pack_true(&w->packer);
    else
        msgpack_pack_false(&w->packer);
}

/* Optional string: written only when not NULL. */
static void put_str(writer *w, map_mark *m, const char *key, const char *s)
{
    if (!s)
        return;
    put_key(w, m, key);
    pack_cstr(w, s);
}

static void put_required_str(writer *w, map_mark *m, const char *where, const char *key,
                             const char *s, bool non_empty)
{
    if (!s || (non_empty && !s[0])) {
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%s%s is required%s", where, key,
                    non_empty ? " and must not be empty" : "");
        return;
    }
    put_str(w, m, key, s);
}

static bool check_array(writer *w, const char *where, const char *key, const void *p, uint32_t n)
{
    if (n && !p) {
        writer_fail(w, KM_ERR_NULL_POINTER, "%s%s: count %u with a NULL array", where, key, n);
        return false;
    }
    return true;
}

static void put_u32_array(writer *w, map_mark *m, const char *where, const char *key,
                          const uint32_t *v, uint32_t n)
{
    if (!check_array(w, where, key, v, n))
        return;
    put_key(w, m, key);
    msgpack_pack_array(&w->packer, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint32(&w->packer, v[i]);
}

static void put_u64_array(writer *w, map_mark *m, const char *where, const char *key,
                          const uint64_t *v, uint32_t n)
{
    if (!check_array(w, where, key, v, n))
        return;
    put_key(w, m, key);
    msgpack_pack_array(&w->packer, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(&w->packer, v[i]);
}

static void put_load(writer *w, map_mark *m, const km_worker_load *load)
{
    map_mark inner;
    put_key(w, m, "load");
    map_begin(w, &inner);
    put_u64(w, &inner, "in_flight", load->in_flight);
    put_u64(w, &inner, "pending_prefill_tokens", load->pending_prefill_tokens);
    put_u64(w, &inner, "active_decode_blocks", load->active_decode_blocks);
    map_end(w, &inner);
}

static void put_item_status(writer *w, map_mark *m, const char *where, int status,
                            const char *message)
{
    if (status == KM_OK) {
        put_i64(w, m, "status", 0);
        return;
    }
    if (status > 0) {
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%sstatus %d is not a km_status code", where,
                    status);
        return;
    }
    put_i64(w, m, "status", status);
    put_str(w, m, "message", message ? message : km_strerror(status));
}

/* "name[i]." into buf (the field-path prefix of an array item's error messages). Written by hand:
 * it runs once per item of every frame, and snprintf was a visible share of encoding a batch. */
static void item_where(char *buf, size_t size, const char *name, uint32_t i)
{
    char digits[10];
    int n = 0;
    do {
        digits[n++] = (char)('0' + i % 10);
        i /= 10;
    } while (i);
    size_t len = strlen(name);
    if (len + (size_t)n + 3 >= size) {
        buf[0] = '\0';
        return;
    }
    memcpy(buf, name, len);
    buf[len++] = '[';
    while (n)
        buf[len++] = digits[--n];
    buf[len++] = ']';
    buf[len++] = '.';
    buf[len] = '\0';
}

static void encode_route(writer *w, const km_route_request *r, uint32_t i)
{
    char where[48];
    item_where(where, sizeof where, "routes", i);
    map_mark m;
    map_begin(w, &m);
    put_required_str(w, &m, where, "request_id", r->request_id, true);
    put_str(w, &m, "attempt_id", r->attempt_id);
    put_str(w, &m, "model", r->model);
    put_str(w, &m, "pool", r->pool);
    put_str(w, &m, "endpoint", r->endpoint);
    if (r->input == KM_ROUTE_INPUT_TOKENS)
        put_u32_array(w, &m, where, "tokens", r->tokens, r->n_tokens);
    else if (r->input == KM_ROUTE_INPUT_HASHES)
        put_u64_array(w, &m, where, "hashes", r->hashes, r->n_hashes);
    else
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%sinput must be tokens or hashes", where);
    if (r->block_size)
        put_u64(w, &m, "block_size", r->block_size);
    put_str(w, &m, "lora_name", r->lora_name);
    put_str(w, &m, "cache_salt", r->cache_salt);
    if (r->candidates)
        put_u32_array(w, &m, where, "candidates", r->candidates, r->n_candidates);
    put_str(w, &m, "policy", r->policy);
    if (r->has_prompt_tokens)
        put_u64(w, &m, "prompt_tokens", r->prompt_tokens);
    if (r->has_expected_output_tokens)
        put_u64(w, &m, "expected_output_tokens", r->expected_output_tokens);
    if (r->brief)
        put_bool(w, &m, "brief", true);
    map_end(w, &m);
}

static void encode_decision(writer *w, const km_route_decision *d, uint32_t i)
{
    char where[48];
    item_where(where, sizeof where, "decisions", i);
    map_mark m;
    map_begin(w, &m);
    put_item_status(w, &m, where, d->status, d->message);
    put_str(w, &m, "request_id", d->request_id);
    put_str(w, &m, "attempt_id", d->attempt_id);
    if (d->status != KM_OK) {
        map_end(w, &m);
        return;
    }
    put_u64(w, &m, "decision_id", d->decision_id);
    put_str(w, &m, "pool", d->pool);
    put_u64(w, &m, "chosen_worker", d->chosen_worker);
    put_u64(w, &m, "chosen_depth", d->chosen_depth);
    put_str(w, &m, "chosen_state", d->chosen_state);
    if (d->has_owner) {
        put_u64(w, &m, "owner_worker", d->owner_worker);
        put_u64(w, &m, "owner_depth", d->owner_depth);
        put_str(w, &m, "owner_state", d->owner_state);
    }
    put_u64(w, &m, "n_blocks", d->n_blocks);
    put_u64(w, &m, "block_size", d->block_size);
    if (d->source != KM_PREDICTION_EVENTS && d->source != KM_PREDICTION_APPROX)
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%ssource must be events or approx", where);
    else
        put_str(w, &m, "source", km_prediction_source_name(d->source));
    put_str(w, &m, "policy", d->policy);
    put_str(w, &m, "reason", d->reason);
    put_str(w, &m, "load_kind", d->load_kind);
    put_str(w, &m, "load_scope", d->load_scope);
    put_double_or_nil(w, &m, "load_value", d->load_value);
    if (check_array(w, where, "candidates", d->candidates, d->n_candidates)) {
        /* Positional rows (docs/PROTOCOL.md, "ROUTE -> DECISION", `candidates`): a decision
         * with 16 candidates is ~180 msgpack values instead of ~400, both ways. */
        put_key(w, &m, "candidates");
        msgpack_pack_array(&w->packer, d->n_candidates);
        for (uint32_t c = 0; c < d->n_candidates; c++) {
            const km_candidate_score *s = &d->candidates[c];
            msgpack_pack_array(&w->packer, KM_CANDIDATE_ROW_FIELDS);
            msgpack_pack_uint32(&w->packer, s->worker);
            msgpack_pack_uint32(&w->packer, s->depth);
            msgpack_pack_uint32(&w->packer, s->device_blocks);
            msgpack_pack_uint32(&w->packer, s->host_blocks);
            msgpack_pack_uint32(&w->packer, s->disk_blocks);
            msgpack_pack_uint32(&w->packer, s->load.in_flight);
            msgpack_pack_uint64(&w->packer, s->load.pending_prefill_tokens);
            msgpack_pack_uint64(&w->packer, s->load.active_decode_blocks);
            if (isfinite(s->cost))
                msgpack_pack_double(&w->packer, s->cost);
            else
                msgpack_pack_nil(&w->packer); /* no cost (round_robin): decoded as NAN */
            if (s->state)
                pack_cstr(w, s->state);
            else
                msgpack_pack_nil(&w->packer);
            if (s->eligible)
                msgpack_pack_true(&w->packer);
            else
                msgpack_pack_false(&w->packer);
        }
    }
    map_end(w, &m);
}

static void encode_lifecycle_event(writer *w, const km_lifecycle_event *e, uint32_t i)
{
    char where[48];
    item_where(where, sizeof where, "events", i);
    map_mark m;
    map_begin(w, &m);
    if (e->kind < KM_LIFECYCLE_DISPATCHED || e->kind > KM_LIFECYCLE_FINISHED)
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%sevent kind %d is not a lifecycle kind", where,
                    (int)e->kind);
    else
        put_str(w, &m, "event", km_lifecycle_kind_name(e->kind));
    if (!e->has_decision_id && !(e->request_id && e->request_id[0]))
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%sneeds decision_id or request_id", where);
    if (e->has_decision_id)
        put_u64(w, &m, "decision_id", e->decision_id);
    put_str(w, &m, "request_id", e->request_id);
    put_str(w, &m, "attempt_id", e->attempt_id);
    if (e->has_worker)
        put_u64(w, &m, "worker", e->worker);
    if (e->has_elapsed_ms && (!(e->elapsed_ms >= 0) || !isfinite(e->elapsed_ms)))
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%selapsed_ms must be finite and >= 0", where);
    if (e->has_elapsed_ms)
        put_double(w, &m, "elapsed_ms", e->elapsed_ms);
    if (e->kind == KM_LIFECYCLE_FINISHED) {
        if (e->outcome != KM_OUTCOME_NONE) {
            if (e->outcome < KM_OUTCOME_COMPLETE || e->outcome > KM_OUTCOME_CANCELLED)
                writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%soutcome %d is not an outcome", where,
                            (int)e->outcome);
            else
                put_str(w, &m, "outcome", km_outcome_name(e->outcome));
        }
        put_str(w, &m, "finish_reason", e->finish_reason);
        put_bool(w, &m, "done_seen", e->done_seen);
        if (e->has_http_status)
            put_u64(w, &m, "http_status", e->http_status);
        put_str(w, &m, "error", e->error);
        if (e->has_cached_tokens)
            put_u64(w, &m, "cached_tokens", e->cached_tokens);
        if (e->has_prompt_tokens)
            put_u64(w, &m, "prompt_tokens", e->prompt_tokens);
        if (e->has_output_tokens)
            put_u64(w, &m, "output_tokens", e->output_tokens);
        put_u64(w, &m, "retries", e->retries);
    }
    map_end(w, &m);
}

static void encode_worker(writer *w, const km_worker_info *wi, uint32_t i, bool runtime)
{
    char where[48];
    item_where(where, sizeof where, "workers", i);
    map_mark m;
    map_begin(w, &m);
    put_required_str(w, &m, where, "pool", wi->pool, true);
    put_u64(w, &m, "worker", wi->worker);
    put_str(w, &m, "name", wi->name);
    put_str(w, &m, "event_endpoint", wi->event_endpoint);
    put_str(w, &m, "replay_endpoint", wi->replay_endpoint);
    if (wi->has_dp_rank)
        put_u64(w, &m, "dp_rank", wi->dp_rank);
    if (wi->has_healthy)
        put_bool(w, &m, "healthy", wi->healthy);
    if (runtime) {
        put_str(w, &m, "state", wi->state);
        if (wi->has_blocks)
            put_u64(w, &m, "blocks", wi->blocks);
        if (wi->has_last_event_age_s)
            put_double(w, &m, "last_event_age_s", wi->last_event_age_s);
        if (wi->has_expected_seq)
            put_u64(w, &m, "expected_seq", wi->expected_seq);
        if (wi->has_load)
            put_load(w, &m, &wi->load);
        put_str(w, &m, "breaker", wi->breaker);
        if (wi->has_failures)
            put_u64(w, &m, "failures", wi->failures);
        if (wi->has_eligible)
            put_bool(w, &m, "eligible", wi->eligible);
    }
    map_end(w, &m);
}

static void encode_workers_array(writer *w, map_mark *m, const km_worker_info *workers,
                                 uint32_t n, bool runtime)
{
    if (!check_array(w, "", "workers", workers, n))
        return;
    put_key(w, m, "workers");
    msgpack_pack_array(&w->packer, n);
    for (uint32_t i = 0; i < n; i++)
        encode_worker(w, &workers[i], i, runtime);
}

static void encode_pool(writer *w, const km_pool_info *p, uint32_t i)
{
    char where[48];
    item_where(where, sizeof where, "pools", i);
    map_mark m;
    map_begin(w, &m);
    put_required_str(w, &m, where, "name", p->name, true);
    put_str(w, &m, "model", p->model);
    if (p->block_size)
        put_u64(w, &m, "block_size", p->block_size);
    put_str(w, &m, "policy", p->policy);
    if (p->n_params && check_array(w, where, "params", p->params, p->n_params)) {
        put_key(w, &m, "params");
        msgpack_pack_map(&w->packer, p->n_params);
        for (uint32_t k = 0; k < p->n_params; k++) {
            if (!p->params[k].name || !p->params[k].name[0]) {
                writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%sparams[%u] has no name", where, k);
                break;
            }
            pack_cstr(w, p->params[k].name);
            msgpack_pack_double(&w->packer, p->params[k].value);
        }
    }
    map_end(w, &m);
}

static void encode_pools_array(writer *w, map_mark *m, const km_pool_info *pools, uint32_t n)
{
    if (!check_array(w, "", "pools", pools, n))
        return;
    put_key(w, m, "pools");
    msgpack_pack_array(&w->packer, n);
    for (uint32_t i = 0; i < n; i++)
        encode_pool(w, &pools[i], i);
}

static void encode_limits(writer *w, map_mark *m, const km_protocol_limits *l)
{
    map_mark lm;
    put_key(w, m, "limits");
    map_begin(w, &lm);
    put_u64(w, &lm, "max_frame_bytes", l->max_frame_bytes);
    put_u64(w, &lm, "max_objects", l->max_objects);
    put_u64(w, &lm, "max_batch_items", l->max_batch_items);
    put_u64(w, &lm, "max_tokens_per_route", l->max_tokens_per_route);
    put_u64(w, &lm, "max_hashes_per_route", l->max_hashes_per_route);
    put_u64(w, &lm, "max_candidates", l->max_candidates);
    put_u64(w, &lm, "max_params", l->max_params);
    put_u64(w, &lm, "max_string_bytes", l->max_string_bytes);
    map_end(w, &lm);
}

static void encode_body(writer *w, map_mark *m, const km_message *msg)
{
    switch (msg->type) {
    case KM_MESSAGE_HELLO:
        put_u64(w, m, "protocol", msg->hello.protocol_version);
        put_str(w, m, "client", msg->hello.client_name);
        break;
    case KM_MESSAGE_WELCOME:
        put_u64(w, m, "protocol", msg->welcome.protocol_version);
        put_required_str(w, m, "", "kvmatch_version", msg->welcome.kvmatch_version, true);
        put_str(w, m, "server", msg->welcome.server_name);
        encode_limits(w, m, &msg->welcome.limits);
        break;
    case KM_MESSAGE_ROUTE:
        if (msg->route.n_routes == 0) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT, "ROUTE needs at least one route");
            break;
        }
        if (!check_array(w, "", "routes", msg->route.routes, msg->route.n_routes))
            break;
        put_key(w, m, "routes");
        msgpack_pack_array(&w->packer, msg->route.n_routes);
        for (uint32_t i = 0; i < msg->route.n_routes; i++)
            encode_route(w, &msg->route.routes[i], i);
        break;
    case KM_MESSAGE_DECISION:
        put_str(w, m, "kvmatch_version", msg->decision.kvmatch_version);
        if (!check_array(w, "", "decisions", msg->decision.decisions, msg->decision.n_decisions))
            break;
        put_key(w, m, "decisions");
        msgpack_pack_array(&w->packer, msg->decision.n_decisions);
        for (uint32_t i = 0; i < msg->decision.n_decisions; i++)
            encode_decision(w, &msg->decision.decisions[i], i);
        break;
    case KM_MESSAGE_LIFECYCLE:
        if (msg->lifecycle.n_events == 0) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT, "LIFECYCLE needs at least one event");
            break;
        }
        if (!check_array(w, "", "events", msg->lifecycle.events, msg->lifecycle.n_events))
            break;
        put_key(w, m, "events");
        msgpack_pack_array(&w->packer, msg->lifecycle.n_events);
        for (uint32_t i = 0; i < msg->lifecycle.n_events; i++)
            encode_lifecycle_event(w, &msg->lifecycle.events[i], i);
        break;
    case KM_MESSAGE_ACK:
        if (!check_array(w, "", "items", msg->ack.items, msg->ack.n_items))
            break;
        put_key(w, m, "items");
        msgpack_pack_array(&w->packer, msg->ack.n_items);
        for (uint32_t i = 0; i < msg->ack.n_items; i++) {
            char where[32];
            item_where(where, sizeof where, "items", i);
            map_mark im;
            map_begin(w, &im);
            put_item_status(w, &im, where, msg->ack.items[i].status, msg->ack.items[i].message);
            map_end(w, &im);
        }
        break;
    case KM_MESSAGE_WORKERS:
        if (msg->workers.action != KM_ADMIN_ADD && msg->workers.action != KM_ADMIN_REMOVE &&
            msg->workers.action != KM_ADMIN_UPDATE && msg->workers.action != KM_ADMIN_LIST) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT,
                        "WORKERS action must be add, remove, update or list");
            break;
        }
        put_str(w, m, "action", km_admin_action_name(msg->workers.action));
        if (msg->workers.action == KM_ADMIN_LIST)
            put_str(w, m, "pool", msg->workers.pool);
        else
            encode_workers_array(w, m, msg->workers.workers, msg->workers.n_workers, false);
        break;
    case KM_MESSAGE_WORKER_LIST:
        encode_workers_array(w, m, msg->workers.workers, msg->workers.n_workers, true);
        break;
    case KM_MESSAGE_POOLS:
        if (msg->pools.action != KM_ADMIN_ADD && msg->pools.action != KM_ADMIN_UPDATE &&
            msg->pools.action != KM_ADMIN_LIST) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT, "POOLS action must be add, update or list");
            break;
        }
        put_str(w, m, "action", km_admin_action_name(msg->pools.action));
        if (msg->pools.action != KM_ADMIN_LIST)
            encode_pools_array(w, m, msg->pools.pools, msg->pools.n_pools);
        break;
    case KM_MESSAGE_POOL_LIST:
        encode_pools_array(w, m, msg->pools.pools, msg->pools.n_pools);
        break;
    case KM_MESSAGE_STATUS:
        break;
    case KM_MESSAGE_STATUS_REPLY: {
        const km_status_reply *s = &msg->status_reply;
        put_required_str(w, m, "", "kvmatch_version", s->kvmatch_version, true);
        put_double(w, m, "uptime_s", s->uptime_s);
        put_bool(w, m, "ready", s->ready);
        put_u64(w, m, "connections", s->connections);
        put_u64(w, m, "decisions", s->decisions);
        put_u64(w, m, "records_dropped", s->records_dropped);
        put_str(w, m, "backend", s->backend);
        encode_workers_array(w, m, s->workers, s->n_workers, true);
        break;
    }
    case KM_MESSAGE_ERROR:
        if (msg->error.code >= 0) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT, "ERROR code %d is not negative",
                        msg->error.code);
            break;
        }
        put_i64(w, m, "code", msg->error.code);
        put_str(w, m, "name", msg->error.name ? msg->error.name : km_error_name(msg->error.code));
        put_str(w, m, "message", msg->error.message ? msg->error.message : "");
        break;
    case KM_MESSAGE_UNKNOWN:
    default:
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "message type %d cannot be encoded",
                    (int)msg->type);
        break;
    }
}

int km_protocol_encode(const km_message *msg, uint32_t max_frame_bytes, km_frame_buffer *buffer,
                       char *why, size_t why_size)
{
    if (why && why_size)
        why[0] = 0;
    if (!msg || !buffer)
        return KM_ERR_NULL_POINTER;
    if (!max_frame_bytes)
        max_frame_bytes = KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES;
    writer w = {.buffer = buffer, .why = why, .why_size = why_size};
    msgpack_packer_init(&w.packer, &w, buffer_append);
    size_t start = buffer->size;
    static const char length_placeholder[KM_FRAME_HEADER_BYTES] = {0};
    buffer_append(&w, length_placeholder, sizeof length_placeholder);
    map_mark m;
    map_begin(&w, &m);
    put_str(&w, &m, "type", km_message_type_name(msg->type));
    put_u64(&w, &m, "id", msg->id);
    encode_body(&w, &m, msg);
    map_end(&w, &m);
    if (w.status == KM_ERR_OUT_OF_MEMORY)
        writer_fail(&w, KM_ERR_OUT_OF_MEMORY, "cannot grow the frame buffer");
    size_t payload = buffer->size - start - KM_FRAME_HEADER_BYTES;
    if (!w.status && payload > max_frame_bytes) {
        w.status = 0;
        writer_fail(&w, KM_ERR_TOO_LARGE, "%s message encodes to %zu bytes, max_frame_bytes is %u",
                    km_message_type_name(msg->type), payload, max_frame_bytes);
    }
    if (w.status) {
        buffer->size = start;
        return w.status;
    }
    uint8_t *h = buffer->data + start;
    h[0] = (uint8_t)(payload >> 24);
    h[1] = (uint8_t)(payload >> 16);
    h[2] = (uint8_t)(payload >> 8);
    h[3] = (uint8_t)payload;
    return KM_OK;
}

int km_protocol_encode_error(uint64_t id, int code, const char *message, km_frame_buffer *buffer)
{
    km_message msg = {.type = KM_MESSAGE_ERROR, .has_id = true, .id = id};
    msg.error.code = code < 0 ? code : KM_ERR_INTERNAL;
    msg.error.name = km_error_name(msg.error.code);
    msg.error.message = message ? message : km_strerror(msg.error.code);
    return km_protocol_encode(&msg, 0, buffer, NULL, 0);
}

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

/* A map's known fields: values[i] is the value of names[i], NULL when absent or nil (nil and
 * absent mean the same for every optional field). Non-string keys and unknown names are ignored;
 * a known name twice is KM_ERR_PARSE. */
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
    unsigned start = 0; /* keys usually come in schema order: try the next name first */
    for (uint32_t k = 0; k < map->via.map.size; k++) {
        const msgpack_object *key = &map->via.map.ptr[k].key;
        if (key->type != MSGPACK_OBJECT_STR || key->via.str.size == 0)
            continue;
        const char *kp = key->via.str.ptr;
        uint32_t kn = key->via.str.size;
        for (unsigned t = 0; t < n_names; t++) {
            unsigned i = start + t < n_names ? start + t : start + t - n_names;
            /* Length first: a key with an embedded NUL ("status\0x") must not pass a strncmp
             * and send the names[i][kn] check past the end of the shorter name. */
            if (names[i][0] != kp[0] || strnlen(names[i], kn + 1) != kn ||
                memcmp(names[i], kp, kn) != 0)
                continue;
            start = i + 1 < n_names ? i + 1 : 0;
            if (seen[i])
                return field_fail(d, KM_ERR_PARSE, names[i], NO_ELEMENT,
                                  "field appears twice in one map");
            seen[i] = true;
            const msgpack_object *v = &map->via.map.ptr[k].val;
            values[i] = v->type == MSGPACK_OBJECT_NIL ? NULL : v;
            break;
        }
    }
    return KM_OK;
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

/* A str within max_string_bytes and without NUL, copied NUL-terminated. */
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
           CACHE_SALT, CANDIDATES, POLICY, PROMPT_TOKENS, EXPECTED_OUTPUT_TOKENS, BRIEF, N_FIELDS };
    static const char *const names[N_FIELDS] = {
        "request_id", "attempt_id", "model",     "pool",       "endpoint",
        "tokens",     "hashes",     "block_size", "lora_name", "cache_salt",
        "candidates", "policy",     "prompt_tokens", "expected_output_tokens", "brief"};
    const msgpack_object *v[N_FIELDS];
    const km_protocol_limits *l = &d->limits;
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
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
    if (v[PROMPT_TOKENS]) {
        if ((rc = read_u64(d, v[PROMPT_TOKENS], "prompt_tokens", &r->prompt_tokens)))
            return rc;
        r->has_prompt_tokens = true;
    }
    if (v[EXPECTED_OUTPUT_TOKENS]) {
        if ((rc = read_u64(d, v[EXPECTED_OUTPUT_TOKENS], "expected_output_tokens",
                           &r->expected_output_tokens)))
            return rc;
        r->has_expected_output_tokens = true;
    }
    if (v[BRIEF] && (rc = read_bool(d, v[BRIEF], "brief", &r->brief)))
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

static int decode_decision(km_protocol_decoder *d, const msgpack_object *o, km_route_decision *r)
{
    enum { STATUS, MESSAGE, REQUEST_ID, ATTEMPT_ID, DECISION_ID, POOL, CHOSEN_WORKER,
           CHOSEN_DEPTH, CHOSEN_STATE, OWNER_WORKER, OWNER_DEPTH, OWNER_STATE, N_BLOCKS,
           BLOCK_SIZE, SOURCE, POLICY, REASON, LOAD_KIND, LOAD_SCOPE, LOAD_VALUE, CANDIDATES,
           N_FIELDS };
    static const char *const names[N_FIELDS] = {
        "status",      "message",      "request_id",   "attempt_id",   "decision_id",
        "pool",        "chosen_worker", "chosen_depth", "chosen_state", "owner_worker",
        "owner_depth", "owner_state",  "n_blocks",     "block_size",   "source",
        "policy",      "reason",       "load_kind",    "load_scope",   "load_value",
        "candidates"};
    const msgpack_object *v[N_FIELDS];
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc)
        return rc;
    int status = KM_OK;
    r->load_value = NAN; /* nil or absent: the policy weighed no load */
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
        (rc = OPT(read_double(d, v[LOAD_VALUE], "load_value", &r->load_value), v[LOAD_VALUE])))
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
    return KM_OK;
}

static const char *const lifecycle_names[] = {
    "event",         "decision_id", "request_id",    "attempt_id",  "worker",
    "elapsed_ms",    "outcome",     "finish_reason", "done_seen",   "http_status",
    "error",         "cached_tokens", "prompt_tokens", "output_tokens", "retries"};
enum { LC_EVENT, LC_DECISION_ID, LC_REQUEST_ID, LC_ATTEMPT_ID, LC_WORKER, LC_ELAPSED_MS,
       LC_OUTCOME, LC_FINISH_REASON, LC_DONE_SEEN, LC_HTTP_STATUS, LC_ERROR, LC_CACHED_TOKENS,
       LC_PROMPT_TOKENS, LC_OUTPUT_TOKENS, LC_RETRIES, LC_N_FIELDS };

static int read_optional_u64(km_protocol_decoder *d, const msgpack_object *o, const char *field,
                             bool *has, uint64_t *out)
{
    if (!o)
        return KM_OK;
    int rc = read_u64(d, o, field, out);
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
        (rc = read_optional_u64(d, v[LC_CACHED_TOKENS], "cached_tokens", &e->has_cached_tokens,
                                &e->cached_tokens)) ||
        (rc = read_optional_u64(d, v[LC_PROMPT_TOKENS], "prompt_tokens", &e->has_prompt_tokens,
                                &e->prompt_tokens)) ||
        (rc = read_optional_u64(d, v[LC_OUTPUT_TOKENS], "output_tokens", &e->has_output_tokens,
                                &e->output_tokens)) ||
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
        (rc = read_optional_u64(d, v[BLOCKS], "blocks", &w->has_blocks, &w->blocks)))
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
    enum { NAME, MODEL, BLOCK_SIZE, POLICY, PARAMS, N_FIELDS };
    static const char *const names[N_FIELDS] = {"name", "model", "block_size", "policy", "params"};
    const msgpack_object *v[N_FIELDS];
    int rc = bind_fields(d, o, NULL, names, N_FIELDS, v);
    if (rc)
        return rc;
    if ((rc = read_nonempty_str(d, v[NAME], "name", &p->name)) ||
        (rc = OPT(read_str(d, v[MODEL], "model", &p->model), v[MODEL])) ||
        (rc = OPT(read_u32(d, v[BLOCK_SIZE], "block_size", &p->block_size), v[BLOCK_SIZE])) ||
        (rc = OPT(read_str(d, v[POLICY], "policy", &p->policy), v[POLICY])))
        return rc;
    if (v[BLOCK_SIZE] && p->block_size == 0)
        return field_fail(d, KM_ERR_PARSE, "block_size", NO_ELEMENT, "must be at least 1");
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
            if (m->pools.action == KM_ADMIN_REMOVE)
                return field_fail(d, KM_ERR_PARSE, "action", NO_ELEMENT,
                                  "POOLS takes add, update or list");
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
    if ((rc = bind_fields(d, &root, NULL, head_names, 2, head)))
        return rc;
    if (head[1]) {
        if ((rc = read_u64(d, head[1], "id", &m->id)))
            return rc;
        m->has_id = true;
    }
    if (!head[0])
        return missing(d, "type");
    if (head[0]->type != MSGPACK_OBJECT_STR)
        return field_fail(d, KM_ERR_PARSE, "type", NO_ELEMENT, "expected a str, got %s",
                          km_msgpack_type_name(head[0]));
    if (!m->has_id)
        return missing(d, "id");
    /* The single-event lifecycle forms: type DISPATCHED / FIRST_TOKEN / FINISHED. */
    km_lifecycle_kind single = lifecycle_kind_named(head[0]->via.str.ptr, head[0]->via.str.size);
    if (single != KM_LIFECYCLE_NONE) {
        m->type = KM_MESSAGE_LIFECYCLE;
        km_lifecycle_event *e = zone_array(d, 1, sizeof *e);
        if (!e)
            return out_of_memory(d);
        d->path[0].name = "events";
        d->path[0].index = 0;
        d->path_depth = 1;
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
    km_message_type type = message_type_named(head[0]->via.str.ptr, head[0]->via.str.size);
    if (type != KM_MESSAGE_UNKNOWN) {
        m->type = type;
        return decode_body(d, &root, m);
    }
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
