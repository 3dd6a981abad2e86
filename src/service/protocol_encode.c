/* SPDX-License-Identifier: Apache-2.0 */
/* The router protocol's encoder (include/kvmatch/protocol.h, "encoder"): every message from its C
 * struct to one length-prefixed msgpack frame appended to a km_frame_buffer, checking what a
 * decoder would refuse in the peer. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "kvmatch/protocol.h"
#include "base/error_detail.h"
#include "base/utf8.h"
#include "service/protocol_internal.h"

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

/* A count of tokens: 0..2^63-1, what a peer's decoder takes (protocol_decode.c, read_count). */
static void put_count(writer *w, map_mark *m, const char *where, const char *key, uint64_t v)
{
    if (v > (uint64_t)INT64_MAX)
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%s%s %" PRIu64 " is over 2^63-1", where, key, v);
    put_u64(w, m, key, v);
}

/* A route's token count: 0..KM_PROTOCOL_MAX_ROUTE_TOKENS (protocol_decode.c, decode_route). */
static void put_route_tokens(writer *w, map_mark *m, const char *where, const char *key,
                             uint64_t v)
{
    if (v > KM_PROTOCOL_MAX_ROUTE_TOKENS)
        writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%s%s %" PRIu64 " is over %" PRIu64, where, key, v,
                    (uint64_t)KM_PROTOCOL_MAX_ROUTE_TOKENS);
    put_u64(w, m, key, v);
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

/* A human-readable message: it may quote a client's text cut at a byte limit (a model name in
 * "no pool serves model ..."), so only its longest well-formed UTF-8 prefix goes out: a msgpack
 * str the peer cannot decode as UTF-8 would fail its whole reply. */
static void put_message(writer *w, map_mark *m, const char *key, const char *s)
{
    size_t len = strlen(s), ok = 0, n;
    while (ok < len && (n = km_utf8_sequence((const unsigned char *)s + ok, len - ok)) > 0)
        ok += n;
    put_key(w, m, key);
    msgpack_pack_str_with_body(&w->packer, s, ok);
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
    put_message(w, m, "message", message ? message : km_strerror(status));
}

/* "name[i]." into buf (the field-path prefix of an array item's error messages). Written by hand:
 * it runs once per item of every frame, where snprintf is a visible share of encoding a batch. */
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
        put_route_tokens(w, &m, where, "prompt_tokens", r->prompt_tokens);
    if (r->has_expected_output_tokens)
        put_route_tokens(w, &m, where, "expected_output_tokens", r->expected_output_tokens);
    if (r->brief)
        put_bool(w, &m, "brief", true);
    if (r->warm_ups)
        put_bool(w, &m, "warm_ups", true);
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
    /* Any scope but this_instance has contributions from elsewhere: other instances, engines. */
    if (d->load_scope && strcmp(d->load_scope, "this_instance") != 0) {
        put_u64(w, &m, "load_instances", d->load_instances);
        put_double_or_nil(w, &m, "load_oldest_age_ms", d->load_oldest_age_ms);
        put_str(w, &m, "load_stale_instances",
                d->load_stale_instances ? d->load_stale_instances : "");
    }
    if (check_array(w, where, "candidates", d->candidates, d->n_candidates)) {
        /* Positional rows (docs/PROTOCOL.md, "ROUTE -> DECISION", `candidates`): less than half
         * the msgpack values of one map per candidate, to encode and to decode. */
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
    if (d->has_warm_up) {
        put_key(w, &m, "warm_up");
        map_mark wm;
        map_begin(w, &wm);
        put_u64(w, &wm, "worker", d->warm_up_worker);
        put_u64(w, &wm, "blocks", d->warm_up_blocks);
        put_u64(w, &wm, "tokens", d->warm_up_tokens);
        put_u64(w, &wm, "decision_id", d->warm_up_decision_id);
        if (!d->warm_up_attempt_id)
            writer_fail(w, KM_ERR_INVALID_ARGUMENT, "%swarm_up.attempt_id is required", where);
        else
            put_str(w, &wm, "attempt_id", d->warm_up_attempt_id);
        map_end(w, &wm);
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
            put_count(w, &m, where, "cached_tokens", e->cached_tokens);
        if (e->has_prompt_tokens)
            put_count(w, &m, where, "prompt_tokens", e->prompt_tokens);
        if (e->has_output_tokens)
            put_count(w, &m, where, "output_tokens", e->output_tokens);
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
            put_count(w, &m, where, "blocks", wi->blocks);
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
    if (p->hash_lookahead_tokens)
        put_u64(w, &m, "hash_lookahead_tokens", p->hash_lookahead_tokens);
    if (p->offload_chunk_blocks)
        put_u64(w, &m, "offload_chunk_blocks", p->offload_chunk_blocks);
    put_str(w, &m, "policy", p->policy);
    put_str(w, &m, "engine", p->engine);
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
            msg->pools.action != KM_ADMIN_REMOVE && msg->pools.action != KM_ADMIN_LIST) {
            writer_fail(w, KM_ERR_INVALID_ARGUMENT,
                        "POOLS action must be add, update, remove or list");
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
        put_message(w, m, "message", msg->error.message ? msg->error.message : "");
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
