/* SPDX-License-Identifier: Apache-2.0 */
/* Linked decision and outcome records: initialisation and JSON formatting
 * (include/kvmatch/records.h, docs/RECORDS.md).
 *
 * Formatting checks every field against what the schema (docs/records.schema.json) requires as it
 * builds the object, so a line that comes out always validates, and a bad field is reported by
 * name (with the nested object it is in). */
#include "kvmatch/records.h"
#include "base/utf8.h"
#include "base/enum_names.h"
#include "base/error_detail.h"
#include "service/records_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

/* ---- small helpers --------------------------------------------------------------------------- */

km_record_time km_record_time_now(void)
{
    km_record_time t;
    t.wall_ns = km_record_clock_ns(CLOCK_REALTIME);
    t.monotonic_ns = km_record_clock_ns(CLOCK_MONOTONIC);
    return t;
}

static const char *const source_names[] = {KM_RECORD_SOURCE_LIST(KM_ENUM_NAME_ENTRY)};
static const char *const input_names[] = {KM_RECORD_INPUT_LIST(KM_ENUM_NAME_ENTRY)};
static const char *const outcome_names[] = {KM_RECORD_OUTCOME_LIST(KM_ENUM_NAME_ENTRY)};

const char *km_record_source_name(km_record_source source)
{
    return KM_ENUM_NAME(source_names, source);
}

const char *km_record_input_name(km_record_input input)
{
    return KM_ENUM_NAME(input_names, input);
}

const char *km_record_outcome_name(km_record_outcome outcome)
{
    return KM_ENUM_NAME(outcome_names, outcome);
}

int km_record_instance_id(char out[33])
{
    unsigned char bytes[16];
    size_t got = 0;
    while (got < sizeof bytes) {
        ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            out[0] = '\0';
            return KM_ERR_IO;
        }
        got += (size_t)n;
    }
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof bytes; i++) {
        out[2 * i] = hex[bytes[i] >> 4];
        out[2 * i + 1] = hex[bytes[i] & 15];
    }
    out[32] = '\0';
    return KM_OK;
}

/* ---- init ------------------------------------------------------------------------------------ */

static void common_init(km_record_common *c)
{
    memset(c, 0, sizeof *c);
    c->time.wall_ns = KM_RECORD_ABSENT;
    c->time.monotonic_ns = KM_RECORD_ABSENT;
}

static km_record_time time_absent(void)
{
    km_record_time t = {KM_RECORD_ABSENT, KM_RECORD_ABSENT};
    return t;
}

void km_record_candidate_init(km_record_candidate *c)
{
    if (!c)
        return;
    memset(c, 0, sizeof *c);
    c->device_blocks = KM_RECORD_ABSENT;
    c->host_blocks = KM_RECORD_ABSENT;
    c->disk_blocks = KM_RECORD_ABSENT;
    c->in_flight = KM_RECORD_ABSENT;
    c->pending_prefill_tokens = KM_RECORD_ABSENT;
    c->active_decode_blocks = KM_RECORD_ABSENT;
    c->queued_depth_blocks = KM_RECORD_ABSENT;
    c->last_arrival = KM_RECORD_ABSENT;
    c->cost = NAN;
    c->eligible = true;
}

void km_decision_record_init(km_decision_record *r)
{
    if (!r)
        return;
    memset(r, 0, sizeof *r);
    common_init(&r->common);
    r->prompt_tokens = KM_RECORD_ABSENT;
    r->expected_output_tokens = KM_RECORD_ABSENT;
    r->scored_monotonic_ns = KM_RECORD_ABSENT;
    r->load_value = NAN;
    r->load_oldest_age_ms = NAN;
    r->predicted_ttft_ms = NAN;
    r->warm_up_for = KM_RECORD_ABSENT;
}

void km_outcome_record_init(km_outcome_record *r)
{
    if (!r)
        return;
    memset(r, 0, sizeof *r);
    common_init(&r->common);
    r->http_status = KM_RECORD_ABSENT;
    r->cached_tokens = KM_RECORD_ABSENT;
    r->prompt_tokens = KM_RECORD_ABSENT;
    r->output_tokens = KM_RECORD_ABSENT;
    r->retries = KM_RECORD_ABSENT;
    r->decided = time_absent();
    r->dispatched = time_absent();
    r->first_token = time_absent();
    r->finished = time_absent();
    r->router_dispatched_ms = NAN;
    r->router_ttft_ms = NAN;
    r->router_e2e_ms = NAN;
}

void km_outcome_record_from_decision(km_outcome_record *o, const km_decision_record *d)
{
    if (!o || !d)
        return;
    o->common = d->common;
    o->decided = d->common.time;
    o->worker = d->chosen.worker;
    o->source = d->source;
    o->block_size = d->block_size;
    o->predicted_depth_blocks = d->chosen.depth_blocks;
    o->owner_worker = d->owner.worker;
    o->owner_depth_blocks = d->owner.depth_blocks;
}

/* ---- JSON writing with validation ------------------------------------------------------------ */

/* The state of one format call: the line being written and the first failure, which wins (later
 * puts are no-ops). Records are written straight into the line, field by field in the order the
 * schema lists them, since a jansson tree built and dumped per record cost the writer thread
 * several times more (docs/BENCHMARKS.md, "IPC"). The output is compact JSON as
 * json_dumps(JSON_COMPACT | JSON_REAL_PRECISION(16)) writes it; the tests parse every line back
 * with jansson. */
#define MAX_DEPTH 4
typedef struct builder {
    int status;
    char *error;
    size_t error_size;
    bool annotated; /* the error already names the object it is in */
    char *buf;
    size_t len, cap;
    int depth;
    bool first[MAX_DEPTH + 1]; /* no member written yet at this nesting depth */
} builder;

static void fail(builder *b, int status, const char *fmt, ...)
{
    if (b->status != KM_OK)
        return;
    b->status = status;
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(b->error, b->error_size, status, fmt, ap);
    va_end(ap);
}

/* After a failure inside a nested object: say which one ("... (in candidates[3])"). */
static void annotate(builder *b, int status_before, const char *fmt, ...)
{
    if (status_before != KM_OK || b->status == KM_OK || b->annotated || !b->error ||
        b->error_size == 0)
        return;
    b->annotated = true;
    char where[96];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(where, sizeof where, fmt, ap);
    va_end(ap);
    size_t used = strlen(b->error);
    if (used < b->error_size)
        snprintf(b->error + used, b->error_size - used, " (in %s)", where);
}

static bool reserve(builder *b, size_t n)
{
    if (b->cap - b->len > n)
        return true; /* room for n bytes and the final NUL */
    size_t cap = b->cap ? b->cap : 1024;
    while (cap - b->len <= n)
        cap *= 2;
    char *grown = realloc(b->buf, cap);
    if (!grown) {
        fail(b, KM_ERR_OUT_OF_MEMORY, "serialising the record");
        return false;
    }
    b->buf = grown;
    b->cap = cap;
    return true;
}

static void emit(builder *b, const char *text, size_t n)
{
    if (b->status != KM_OK || !reserve(b, n))
        return;
    memcpy(b->buf + b->len, text, n);
    b->len += n;
}

/* A member's key (keys are this file's own ASCII names) or, for key NULL, an array element: the
 * comma before it unless it is the first. */
static void begin_value(builder *b, const char *key)
{
    size_t klen = key ? strlen(key) : 0;
    if (b->status != KM_OK || !reserve(b, klen + 4))
        return;
    char *p = b->buf + b->len;
    if (!b->first[b->depth])
        *p++ = ',';
    b->first[b->depth] = false;
    if (key) {
        *p++ = '"';
        memcpy(p, key, klen);
        p += klen;
        *p++ = '"';
        *p++ = ':';
    }
    b->len = (size_t)(p - b->buf);
}

static void open_container(builder *b, const char *key, char bracket)
{
    if (b->status != KM_OK)
        return;
    if (b->depth == MAX_DEPTH) {
        fail(b, KM_ERR_INTERNAL, "records nest at most %d deep", MAX_DEPTH);
        return;
    }
    begin_value(b, key);
    emit(b, &bracket, 1);
    b->first[++b->depth] = true;
}

static void close_container(builder *b, char bracket)
{
    if (b->status != KM_OK)
        return;
    emit(b, &bracket, 1);
    b->depth--;
}

static void put_null(builder *b, const char *key)
{
    if (b->status != KM_OK)
        return;
    begin_value(b, key);
    emit(b, "null", 4);
}

static void put_bool(builder *b, const char *key, bool value)
{
    if (b->status != KM_OK)
        return;
    begin_value(b, key);
    emit(b, value ? "true" : "false", value ? 4 : 5);
}

static void put_int(builder *b, const char *key, int64_t value)
{
    if (b->status != KM_OK)
        return;
    char digits[24];
    int n = 0;
    uint64_t v = value < 0 ? 0 - (uint64_t)value : (uint64_t)value;
    do {
        digits[sizeof digits - 1 - n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    if (value < 0)
        digits[sizeof digits - 1 - n++] = '-';
    begin_value(b, key);
    emit(b, digits + sizeof digits - n, (size_t)n);
}


/* A JSON string: '"', '\' and control characters escaped, everything else (UTF-8) as it is;
 * invalid UTF-8 fails the record. */
static void emit_string(builder *b, const char *key, const char *value)
{
    const unsigned char *s = (const unsigned char *)value;
    size_t n = strlen(value);
    for (size_t i = 0; i < n;) {
        size_t k = km_utf8_sequence(s + i, n - i);
        if (!k) {
            fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is not valid UTF-8", key ? key : "value");
            return;
        }
        i += k;
    }
    begin_value(b, key);
    if (!reserve(b, 2 + 6 * n)) /* every byte escaped as \u00XX at worst */
        return;
    char *o = b->buf + b->len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *o++ = (char)c;
            continue;
        }
        *o++ = '\\';
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        default: {
            static const char hex[] = "0123456789ABCDEF";
            *o++ = 'u';
            *o++ = '0';
            *o++ = '0';
            *o++ = hex[c >> 4];
            *o++ = hex[c & 15];
        }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->buf);
}

/* A string field; NULL is JSON null unless required. */
static void put_string(builder *b, const char *key, const char *value, bool required)
{
    if (b->status != KM_OK)
        return;
    if (!value) {
        if (required)
            fail(b, KM_ERR_NULL_POINTER, "field %s is required", key);
        else
            put_null(b, key);
        return;
    }
    emit_string(b, key, value);
}

/* An index state name: upper-case letters and '_', non-empty. */
static void put_state(builder *b, const char *key, const char *value, bool required)
{
    if (b->status != KM_OK)
        return;
    if (value) {
        if (value[0] == '\0') {
            fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is empty", key);
            return;
        }
        for (const char *p = value; *p; p++) {
            if (!((*p >= 'A' && *p <= 'Z') || *p == '_')) {
                fail(b, KM_ERR_INVALID_ARGUMENT,
                     "field %s must be upper-case letters and '_' (an index state such as LIVE)",
                     key);
                return;
            }
        }
    }
    put_string(b, key, value, required);
}

/* A lower-case name (policy, load kind): lower-case letters, digits and '_', non-empty. */
static void put_name(builder *b, const char *key, const char *value, bool required)
{
    if (b->status != KM_OK)
        return;
    if (value) {
        if (value[0] == '\0') {
            fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is empty", key);
            return;
        }
        for (const char *p = value; *p; p++) {
            if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_')) {
                fail(b, KM_ERR_INVALID_ARGUMENT,
                     "field %s must be lower-case letters, digits and '_'", key);
                return;
            }
        }
    }
    put_string(b, key, value, required);
}

/* A non-negative integer; KM_RECORD_ABSENT is JSON null unless required. */
static void put_count(builder *b, const char *key, int64_t value, bool required)
{
    if (b->status != KM_OK)
        return;
    if (value == KM_RECORD_ABSENT) {
        if (required)
            fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is required (it is absent)", key);
        else
            put_null(b, key);
        return;
    }
    if (value < 0) {
        fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is negative (%" PRId64 ")", key, value);
        return;
    }
    put_int(b, key, value);
}

/* blocks * block_size, or absent when blocks is; block_size >= 1 was checked. */
static void put_tokens(builder *b, const char *key, int64_t blocks, int64_t block_size)
{
    if (b->status != KM_OK)
        return;
    if (blocks == KM_RECORD_ABSENT || blocks < 0) {
        put_null(b, key);
        return;
    }
    if (blocks > INT64_MAX / block_size) {
        fail(b, KM_ERR_INVALID_ARGUMENT, "field %s overflows (%" PRId64 " blocks of %" PRId64 ")",
             key, blocks, block_size);
        return;
    }
    put_int(b, key, blocks * block_size);
}

/* A finite real with 16 significant digits (0.1 stays "0.1"; 17 would print
 * 0.10000000000000001; 17 only above 1.7e308), always with a '.' or an exponent so it reads back
 * as a real, exponents without '+' or leading zeros; NAN is null. */
static void put_real(builder *b, const char *key, double value)
{
    if (b->status != KM_OK)
        return;
    if (isnan(value)) {
        put_null(b, key);
        return;
    }
    if (!isfinite(value)) {
        fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is infinite", key);
        return;
    }
    /* Whole numbers below 2^53 (costs and loads usually are): "%.16g" prints every digit with
     * no exponent, so the integer's digits and ".0" are the same text, without printf's cost (a
     * fifth of the writer's time with 16 candidates a record). -0.0 is left to printf. */
    if (fabs(value) < 9007199254740992.0 && value == (double)(int64_t)value &&
        (value != 0 || !signbit(value))) {
        put_int(b, key, (int64_t)value);
        emit(b, ".0", 2);
        return;
    }
    char text[40];
    /* Near DBL_MAX, 16 digits round up past it (1.797693134862316e308 reads back as infinity):
     * 17 there. */
    int n = snprintf(text, sizeof text - 2, fabs(value) > 1.7e308 ? "%.17g" : "%.16g", value);
    if (n < 0 || n >= (int)sizeof text - 2) {
        fail(b, KM_ERR_INTERNAL, "field %s: cannot format %g", key, value);
        return;
    }
    char *e = strchr(text, 'e');
    if (!e && !strchr(text, '.')) {
        text[n++] = '.';
        text[n++] = '0';
        text[n] = '\0';
    } else if (e) {
        char *from = e + 1, *to = e + 1;
        if (*from == '-')
            from++, to++;
        else if (*from == '+')
            from++;
        while (*from == '0' && from[1])
            from++;
        memmove(to, from, strlen(from) + 1);
        n = (int)strlen(text);
    }
    begin_value(b, key);
    emit(b, text, (size_t)n);
}

static void put_flag(builder *b, const char *key, km_record_flag value)
{
    if (b->status != KM_OK)
        return;
    switch (value) {
    case KM_RECORD_FLAG_UNKNOWN: put_null(b, key); return;
    case KM_RECORD_FLAG_FALSE: put_bool(b, key, false); return;
    case KM_RECORD_FLAG_TRUE: put_bool(b, key, true); return;
    }
    fail(b, KM_ERR_INVALID_ARGUMENT, "field %s has no such km_record_flag value (%d)", key,
         (int)value);
}

/* RFC 3339 UTC with microseconds: 2026-11-30T12:34:56.123456Z. */
static void put_wall(builder *b, const char *key, int64_t wall_ns, bool required)
{
    if (b->status != KM_OK)
        return;
    if (wall_ns == KM_RECORD_ABSENT) {
        if (required)
            fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is required (it is absent)", key);
        else
            put_null(b, key);
        return;
    }
    if (wall_ns < 0) {
        fail(b, KM_ERR_INVALID_ARGUMENT, "field %s is before 1970 (%" PRId64 " ns)", key, wall_ns);
        return;
    }
    time_t seconds = (time_t)(wall_ns / INT64_C(1000000000));
    long micros = (long)((wall_ns % INT64_C(1000000000)) / 1000);
    struct tm tm;
    if (!gmtime_r(&seconds, &tm)) {
        fail(b, KM_ERR_INVALID_ARGUMENT, "field %s: no calendar time for %" PRId64 " ns", key,
             wall_ns);
        return;
    }
    char text[64];
    snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, micros);
    emit_string(b, key, text);
}

/* "<prefix>_time" and "<prefix>_monotonic_ns" (or "time" and "monotonic_ns" for prefix NULL). */
static void put_time(builder *b, const char *prefix, km_record_time t, bool required)
{
    char wall_key[64], mono_key[64];
    if (prefix) {
        snprintf(wall_key, sizeof wall_key, "%s_time", prefix);
        snprintf(mono_key, sizeof mono_key, "%s_monotonic_ns", prefix);
    } else {
        snprintf(wall_key, sizeof wall_key, "time");
        snprintf(mono_key, sizeof mono_key, "monotonic_ns");
    }
    put_wall(b, wall_key, t.wall_ns, required);
    put_count(b, mono_key, t.monotonic_ns, required);
}

/* later - earlier on the monotonic clock, null unless both are present; negative is a caller bug. */
static void put_duration(builder *b, const char *key, int64_t earlier, int64_t later)
{
    if (b->status != KM_OK)
        return;
    if (earlier == KM_RECORD_ABSENT || later == KM_RECORD_ABSENT) {
        put_null(b, key);
        return;
    }
    if (later < earlier) {
        fail(b, KM_ERR_INVALID_ARGUMENT,
             "field %s would be negative: the later monotonic time (%" PRId64
             ") is before the earlier one (%" PRId64 ")",
             key, later, earlier);
        return;
    }
    put_int(b, key, later - earlier);
}

static void put_common(builder *b, const char *type, const km_record_common *c)
{
    emit_string(b, "type", type);
    put_int(b, "schema_version", KM_RECORD_SCHEMA_VERSION);
    put_count(b, "record_id", c->record_id, true);
    put_string(b, "instance", c->instance, true);
    put_string(b, "host", c->host, false);
    put_string(b, "kvmatch_version", c->kvmatch_version, true);
    put_count(b, "decision_id", c->decision_id, true);
    put_string(b, "request_id", c->request_id, true);
    put_string(b, "attempt_id", c->attempt_id, true);
    put_string(b, "model", c->model, true);
    put_string(b, "pool", c->pool, true);
    put_string(b, "endpoint", c->endpoint, false);
    put_time(b, NULL, c->time, true);
}

/* key: {"worker", "state", "depth_blocks", "depth_tokens"}; worker_required for the chosen
 * worker. Without a worker there is no state and the depth is 0 (docs/RECORDS.md). */
static void put_worker(builder *b, const char *key, const char *what, const km_record_worker *w,
                       int64_t block_size, bool worker_required)
{
    int status_before = b->status;
    open_container(b, key, '{');
    put_string(b, "worker", w->worker, worker_required);
    if (b->status == KM_OK && w->worker && !w->state)
        fail(b, KM_ERR_NULL_POINTER, "field state is required when worker is set");
    if (b->status == KM_OK && !w->worker && (w->state || w->depth_blocks != 0))
        fail(b, KM_ERR_INVALID_ARGUMENT,
             "no worker, so field state must be null and depth_blocks 0 (%s, %" PRId64 ")",
             w->state ? w->state : "null", w->depth_blocks);
    put_state(b, "state", w->state, false);
    put_count(b, "depth_blocks", w->depth_blocks, true);
    put_tokens(b, "depth_tokens", w->depth_blocks, block_size);
    close_container(b, '}');
    annotate(b, status_before, "%s", what);
}

static int finish(builder *b, char **line, size_t *len)
{
    if (b->status == KM_OK && b->depth != 0)
        fail(b, KM_ERR_INTERNAL, "the record's objects are not all closed");
    if (b->status == KM_OK && reserve(b, 0)) {
        b->buf[b->len] = '\0';
        *line = b->buf;
        *len = b->len;
        return KM_OK;
    }
    free(b->buf);
    b->buf = NULL;
    return b->status;
}

static bool start(builder *b, char *error, size_t error_size, const void *record, char **line,
                  size_t *len)
{
    memset(b, 0, sizeof *b);
    b->status = KM_OK;
    b->error = error;
    b->error_size = error_size;
    b->first[0] = true;
    if (error && error_size)
        error[0] = '\0';
    if (line)
        *line = NULL;
    if (len)
        *len = 0;
    if (!record || !line || !len) {
        fail(b, KM_ERR_NULL_POINTER, "%s is NULL", !record ? "record" : !line ? "line" : "len");
        return false;
    }
    return true;
}

int km_decision_record_format(const km_decision_record *r, char **line, size_t *len, char *error,
                              size_t error_size)
{
    builder b;
    if (!start(&b, error, error_size, r, line, len))
        return b.status;
    if (r->source != KM_RECORD_SOURCE_EVENTS && r->source != KM_RECORD_SOURCE_APPROX)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field prediction.source has no such value (%d)",
             (int)r->source);
    else if (r->input != KM_RECORD_INPUT_TOKENS && r->input != KM_RECORD_INPUT_HASHES)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field prediction.input has no such value (%d)",
             (int)r->input);
    else if (r->block_size < 1)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field prediction.block_size must be >= 1 (%" PRId64 ")",
             r->block_size);
    else if (r->n_candidates > KM_RECORD_MAX_CANDIDATES)
        fail(&b, KM_ERR_TOO_LARGE, "%zu candidates (at most %u)", r->n_candidates,
             KM_RECORD_MAX_CANDIDATES);
    else if (r->n_candidates > 0 && !r->candidates)
        fail(&b, KM_ERR_NULL_POINTER, "candidates is NULL with n_candidates %zu", r->n_candidates);
    if (b.status != KM_OK)
        return b.status;

    open_container(&b, NULL, '{');
    put_common(&b, "decision", &r->common);

    int before = b.status; /* a nested object names itself in the error it caused, not in others */
    open_container(&b, "prediction", '{');
    emit_string(&b, "source", km_record_source_name(r->source));
    emit_string(&b, "input", km_record_input_name(r->input));
    emit_string(&b, "units", "blocks");
    put_count(&b, "block_size", r->block_size, true);
    put_count(&b, "block_count", r->block_count, true);
    put_count(&b, "prompt_tokens", r->prompt_tokens, false);
    put_count(&b, "expected_output_tokens", r->expected_output_tokens, false);
    put_count(&b, "scored_monotonic_ns", r->scored_monotonic_ns, false);
    put_worker(&b, "owner", "prediction.owner", &r->owner, r->block_size, false);
    close_container(&b, '}');
    annotate(&b, before, "prediction");

    before = b.status;
    open_container(&b, "decision", '{');
    put_name(&b, "policy", r->policy, true);
    put_string(&b, "reason", r->reason, false);
    put_worker(&b, "chosen", "decision.chosen", &r->chosen, r->block_size, true);
    bool same = r->owner.worker && r->chosen.worker && strcmp(r->owner.worker, r->chosen.worker) == 0;
    put_bool(&b, "owner_is_chosen", same);
    if (b.status == KM_OK && r->predicted_ttft_ms < 0)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field decision.predicted_ttft_ms is negative (%g)",
             r->predicted_ttft_ms);
    put_real(&b, "predicted_ttft_ms", r->predicted_ttft_ms);
    open_container(&b, "load", '{');
    put_name(&b, "kind", r->load_kind, true);
    put_real(&b, "value", r->load_value);
    /* The load scopes a decision may state (docs/RECORDS.md, decision.load.scope); every one but
     * this_instance carries the contributions' fields. */
    static const char *const scopes[] = {"this_instance", "cluster",
                                         "this_instance+engine_reported",
                                         "cluster+engine_reported"};
    const char *scope = "this_instance";
    for (size_t i = 0; r->load_scope && i < sizeof scopes / sizeof scopes[0]; i++)
        if (strcmp(r->load_scope, scopes[i]) == 0)
            scope = scopes[i];
    if (r->load_scope && strcmp(scope, r->load_scope) != 0)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field decision.load.scope is \"%s\", not "
             "this_instance, cluster, this_instance+engine_reported or cluster+engine_reported",
             r->load_scope);
    emit_string(&b, "scope", scope);
    if (strcmp(scope, "this_instance") != 0) {
        put_count(&b, "instances", r->load_instances < 0 ? 0 : r->load_instances, true);
        if (b.status == KM_OK && r->load_oldest_age_ms < 0)
            fail(&b, KM_ERR_INVALID_ARGUMENT, "field decision.load.oldest_age_ms is negative (%g)",
                 r->load_oldest_age_ms);
        put_real(&b, "oldest_age_ms", r->load_oldest_age_ms);
        open_container(&b, "stale_instances", '[');
        /* Comma-separated cluster instance ids: at most 8, each 1..64 of [A-Za-z0-9_-] (the
         * schema's bounds; the cluster refuses other ids). */
        size_t n_ids = 0;
        for (const char *p = r->load_stale_instances; p && *p && b.status == KM_OK;) {
            const char *comma = strchr(p, ',');
            size_t n = comma ? (size_t)(comma - p) : strlen(p);
            size_t ok = strspn(p, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                  "0123456789_-");
            if (n == 0 || n > 64 || ok < n || ++n_ids > 8) {
                fail(&b, KM_ERR_INVALID_ARGUMENT, "field decision.load.stale_instances: %s",
                     n_ids > 8 ? "more than 8 ids"
                               : "an id must be 1 to 64 of A-Z, a-z, 0-9, '_' and '-'");
                break;
            }
            char id[65];
            memcpy(id, p, n);
            id[n] = '\0';
            emit_string(&b, NULL, id);
            p += n + (comma != NULL);
        }
        close_container(&b, ']');
    }
    close_container(&b, '}');
    if (r->warm_up.worker) {
        int warm_before = b.status;
        open_container(&b, "warm_up", '{');
        put_string(&b, "worker", r->warm_up.worker, true);
        put_count(&b, "blocks", r->warm_up.blocks, true);
        put_tokens(&b, "tokens", r->warm_up.blocks, r->block_size);
        put_count(&b, "decision_id", r->warm_up.decision_id, true);
        close_container(&b, '}');
        annotate(&b, warm_before, "warm_up");
    } else {
        put_null(&b, "warm_up");
    }
    put_count(&b, "warm_up_for", r->warm_up_for, false);
    close_container(&b, '}');
    annotate(&b, before, "decision");

    open_container(&b, "candidates", '[');
    for (size_t i = 0; i < r->n_candidates && b.status == KM_OK; i++) {
        const km_record_candidate *c = &r->candidates[i];
        open_container(&b, NULL, '{');
        put_string(&b, "worker", c->worker, true);
        put_state(&b, "state", c->state, true);
        put_count(&b, "depth_blocks", c->depth_blocks, true);
        put_tokens(&b, "depth_tokens", c->depth_blocks, r->block_size);
        put_count(&b, "device_blocks", c->device_blocks, false);
        put_count(&b, "host_blocks", c->host_blocks, false);
        put_count(&b, "disk_blocks", c->disk_blocks, false);
        put_count(&b, "in_flight", c->in_flight, false);
        put_count(&b, "pending_prefill_tokens", c->pending_prefill_tokens, false);
        put_count(&b, "active_decode_blocks", c->active_decode_blocks, false);
        put_count(&b, "queued_depth_blocks", c->queued_depth_blocks, false);
        put_count(&b, "last_arrival", c->last_arrival, false);
        put_real(&b, "cost", c->cost);
        put_bool(&b, "eligible", c->eligible);
        close_container(&b, '}');
        annotate(&b, KM_OK, "candidates[%zu]", i);
    }
    close_container(&b, ']');
    close_container(&b, '}');
    return finish(&b, line, len);
}

int km_outcome_record_format(const km_outcome_record *r, char **line, size_t *len, char *error,
                             size_t error_size)
{
    builder b;
    if (!start(&b, error, error_size, r, line, len))
        return b.status;
    if (r->outcome < KM_RECORD_OUTCOME_COMPLETE || r->outcome > KM_RECORD_OUTCOME_EXPIRED)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field outcome has no such value (%d)", (int)r->outcome);
    else if (r->source != KM_RECORD_SOURCE_EVENTS && r->source != KM_RECORD_SOURCE_APPROX)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field predicted.source has no such value (%d)",
             (int)r->source);
    else if (r->block_size < 1)
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field predicted.block_size must be >= 1 (%" PRId64 ")",
             r->block_size);
    else if (r->http_status != KM_RECORD_ABSENT && (r->http_status < 0 || r->http_status > 999))
        fail(&b, KM_ERR_INVALID_ARGUMENT, "field http_status is outside 0..999 (%" PRId64 ")",
             r->http_status);
    if (b.status != KM_OK)
        return b.status;

    open_container(&b, NULL, '{');
    put_common(&b, "outcome", &r->common);
    emit_string(&b, "outcome", km_record_outcome_name(r->outcome));
    put_string(&b, "finish_reason", r->finish_reason, false);
    put_flag(&b, "done_seen", r->done_seen);
    put_count(&b, "http_status", r->http_status, false);
    put_string(&b, "error", r->error, false);
    put_string(&b, "worker", r->worker, true);
    put_string(&b, "dispatched_worker", r->dispatched_worker, false);
    put_count(&b, "cached_tokens", r->cached_tokens, false);
    put_count(&b, "prompt_tokens", r->prompt_tokens, false);
    put_count(&b, "output_tokens", r->output_tokens, false);
    put_count(&b, "retries", r->retries, false);
    put_time(&b, "decided", r->decided, false);
    put_time(&b, "dispatched", r->dispatched, false);
    put_time(&b, "first_token", r->first_token, false);
    put_time(&b, "finished", r->finished, false);
    put_duration(&b, "wait_ns", r->decided.monotonic_ns, r->dispatched.monotonic_ns);
    put_duration(&b, "ttft_ns", r->decided.monotonic_ns, r->first_token.monotonic_ns);
    if (b.status == KM_OK &&
        ((!isnan(r->router_dispatched_ms) && !(r->router_dispatched_ms >= 0)) ||
         (!isnan(r->router_ttft_ms) && !(r->router_ttft_ms >= 0)) ||
         (!isnan(r->router_e2e_ms) && !(r->router_e2e_ms >= 0))))
        fail(&b, KM_ERR_INVALID_ARGUMENT, "the router_*_ms fields must be >= 0 or NAN (null)");
    put_real(&b, "router_dispatched_ms", r->router_dispatched_ms);
    put_real(&b, "router_ttft_ms", r->router_ttft_ms);
    put_real(&b, "router_e2e_ms", r->router_e2e_ms);

    int before = b.status; /* as in km_decision_record_format */
    open_container(&b, "predicted", '{');
    emit_string(&b, "source", km_record_source_name(r->source));
    emit_string(&b, "units", "blocks");
    put_count(&b, "block_size", r->block_size, true);
    put_count(&b, "depth_blocks", r->predicted_depth_blocks, true);
    put_tokens(&b, "depth_tokens", r->predicted_depth_blocks, r->block_size);
    put_string(&b, "owner_worker", r->owner_worker, false);
    put_count(&b, "owner_depth_blocks", r->owner_depth_blocks, true);
    put_tokens(&b, "owner_depth_tokens", r->owner_depth_blocks, r->block_size);
    close_container(&b, '}');
    annotate(&b, before, "predicted");
    close_container(&b, '}');
    return finish(&b, line, len);
}
