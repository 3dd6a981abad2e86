/* SPDX-License-Identifier: Apache-2.0 */
/* Workload traces: loads the Mooncake FAST'25 JSONL trace with jansson, line by line and within
 * hard limits, and expands a request's 512-token ids into this project's chain hashes
 * (docs/HASHING.md, "Trace expansion"). The loader keeps every request's ids in one pool so a
 * 12k-request trace costs two allocations, not twelve thousand. */
#include "sim/trace.h"

#include "base/array.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"
#include "kvmatch/hash.h"

#define KM_TRACE_DEFAULT_PATH "../shared/data/mooncake/conversation_trace.jsonl"
/* Hard limits on wire input: a longer line, a longer id list or more requests fail the load. */
#define KM_TRACE_MAX_LINE_BYTES (UINT64_C(16) << 20)
#define KM_TRACE_MAX_IDS_PER_REQUEST (UINT32_C(1) << 20)
#define KM_TRACE_MAX_REQUESTS (UINT64_C(1) << 26)
/* Token j of an id is derived from id * 2^20 + j, so ids stay apart while tokens_per_id <= 2^20. */
#define KM_TRACE_ID_SHIFT 20
#define KM_TRACE_MAX_TOKENS_PER_ID (UINT32_C(1) << KM_TRACE_ID_SHIFT)
/* Tokens expanded and hashed per km_hash_sequence call (bounded scratch for any request size). */
#define KM_TRACE_CHUNK_TOKENS 8192u

const char *km_trace_default_path(void)
{
    const char *env = getenv("KM_MOONCAKE_TRACE");
    return (env && env[0]) ? env : KM_TRACE_DEFAULT_PATH;
}

static void trace_error(char *err, size_t err_size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void trace_error(char *err, size_t err_size, const char *fmt, ...)
{
    if (!err || err_size == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
}

/* A non-negative integer field no larger than max; a real is taken, truncated, where
 * truncate_real, else only when integral. Returns 0 on success. */
static int field_u64(json_t *obj, const char *name, uint64_t max, int truncate_real, uint64_t *out,
                     const char **why)
{
    json_t *v = json_object_get(obj, name);
    if (!v) {
        *why = "missing field";
        return -1;
    }
    if (json_is_integer(v)) {
        json_int_t x = json_integer_value(v);
        if (x < 0 || (uint64_t)x > max) {
            *why = "value out of range";
            return -1;
        }
        *out = (uint64_t)x;
        return 0;
    }
    /* Some trace tools write timestamps as reals: accept a finite non-negative real, truncated.
     * A token count is an integer: a fraction is refused, not truncated. */
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (!isfinite(d) || d < 0.0 || d > (double)max) {
            *why = "value out of range";
            return -1;
        }
        if (!truncate_real && d != floor(d)) {
            *why = "not an integer";
            return -1;
        }
        *out = (uint64_t)d;
        return 0;
    }
    *why = "not a number";
    return -1;
}

/* Where the JSON of a line failed to parse (at byte `at` of text): ' (field "NAME")' for the last
 * key written before that point (a number too large for an integer is refused while its field is
 * read), or "" when none reads there. */
static void key_before(const char *text, size_t len, int at, char *out, size_t size)
{
    out[0] = '\0';
    size_t end = at < 0 ? 0 : (size_t)at < len ? (size_t)at : len;
    while (end >= 2 && !(text[end - 1] == ':' && text[end - 2] == '"'))
        end--;
    if (end < 2)
        return;
    size_t close = end - 2, open = close;
    while (open > 0 && text[open - 1] != '"')
        open--;
    if (open == 0 || close - open > 48)
        return;
    snprintf(out, size, " (field \"%.*s\")", (int)(close - open), text + open);
}

/* Validate one parsed line. Returns NULL, or why it is bad (*field names the field, if any). */
static const char *check_request(json_t *obj, uint64_t *ts, uint64_t *in_len, uint64_t *out_len,
                                 json_t **ids, const char **field)
{
    const char *why = NULL;
    *field = NULL;
    if (!json_is_object(obj))
        return "not a JSON object";
    *field = "timestamp";
    if (field_u64(obj, *field, KM_TRACE_MAX_TIMESTAMP_MS, 1, ts, &why) != 0)
        return why;
    *field = "input_length";
    if (field_u64(obj, *field, UINT32_MAX, 0, in_len, &why) != 0)
        return why;
    *field = "output_length";
    if (field_u64(obj, *field, UINT32_MAX, 0, out_len, &why) != 0)
        return why;
    *field = "hash_ids";
    *ids = json_object_get(obj, *field);
    if (!*ids)
        return "missing field";
    if (!json_is_array(*ids))
        return "not an array";
    if (json_array_size(*ids) == 0)
        return "empty"; /* no prompt to expand */
    if (json_array_size(*ids) > KM_TRACE_MAX_IDS_PER_REQUEST)
        return "too many ids";
    *field = NULL;
    return NULL;
}

static int is_blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return 0;
    return 1;
}

/* Grow *p (elements of size `size`) to hold at least `need`; doubles. Returns 0 or -1. */

enum { LINE_OK, LINE_END, LINE_TOO_LONG, LINE_NO_MEMORY };

/* Read one line (its newline included, if any; NUL bytes kept) into *buf, stopping as soon as it
 * would pass max bytes, so an oversize line costs at most max bytes of memory whatever its length.
 * Returns LINE_OK (*len set), LINE_END (end of file or read error: see ferror), LINE_TOO_LONG or
 * LINE_NO_MEMORY. */
static int read_line(FILE *f, char **buf, size_t *cap, size_t max, size_t *len)
{
    size_t n = 0;
    int c = EOF;
    while ((c = getc_unlocked(f)) != EOF) {
        if (n == max)
            return LINE_TOO_LONG;
        if (km_array_grow(buf, cap, n + 1, 1, 256) != KM_OK)
            return LINE_NO_MEMORY;
        (*buf)[n++] = (char)c;
        if (c == '\n')
            break;
    }
    *len = n;
    return n == 0 || ferror(f) ? LINE_END : LINE_OK;
}

int km_trace_load_mooncake(const char *path, km_trace *out, char *err, size_t err_size)
{
    if (err && err_size)
        err[0] = '\0';
    if (!path || !out) {
        trace_error(err, err_size, "km_trace_load_mooncake: NULL %s", path ? "output" : "path");
        return KM_ERR_NULL_POINTER;
    }
    memset(out, 0, sizeof(*out));
    FILE *f = fopen(path, "r");
    if (!f) {
        trace_error(err, err_size, "cannot open trace %s: %s", path, strerror(errno));
        return KM_ERR_IO;
    }

    km_trace t = {0};
    size_t req_cap = 0, pool_cap = 0;
    /* ids are stored as offsets while the pool may move; pointers are fixed up at the end. */
    size_t *offsets = NULL, offsets_cap = 0;
    char *line = NULL;
    size_t line_cap = 0;
    uint64_t line_no = 0, last_line = 0; /* last_line: the last request's */
    int status = KM_OK;
    size_t len = 0;
    int got;

    errno = 0;
    while ((got = read_line(f, &line, &line_cap, KM_TRACE_MAX_LINE_BYTES, &len)) != LINE_END) {
        line_no++;
        if (got == LINE_TOO_LONG) {
            trace_error(err, err_size, "%s:%llu: line longer than %llu bytes", path,
                        (unsigned long long)line_no, (unsigned long long)KM_TRACE_MAX_LINE_BYTES);
            status = KM_ERR_TOO_LARGE;
            goto done;
        }
        if (got == LINE_NO_MEMORY) {
            trace_error(err, err_size, "%s:%llu: out of memory", path, (unsigned long long)line_no);
            status = KM_ERR_OUT_OF_MEMORY;
            goto done;
        }
        char *text = line;
        /* A byte order mark opening the file (RFC 8259 lets a parser ignore it, and some editors
         * write one) is skipped; anywhere else it is text of the line, refused as invalid JSON. */
        if (line_no == 1 && len >= 3 && !memcmp(line, "\xEF\xBB\xBF", 3)) {
            text += 3;
            len -= 3;
        }
        if (is_blank(text, len))
            continue;
        if (t.n_requests >= KM_TRACE_MAX_REQUESTS) {
            trace_error(err, err_size, "%s:%llu: more than %llu requests", path,
                        (unsigned long long)line_no, (unsigned long long)KM_TRACE_MAX_REQUESTS);
            status = KM_ERR_TOO_LARGE;
            goto done;
        }
        json_error_t jerr;
        json_t *obj = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
        if (!obj) {
            char field_hint[80];
            key_before(text, len, jerr.position, field_hint, sizeof field_hint);
            trace_error(err, err_size, "%s:%llu: invalid JSON at column %d%s: %s", path,
                        (unsigned long long)line_no, jerr.column, field_hint, jerr.text);
            status = KM_ERR_PARSE;
            goto done;
        }
        const char *field = NULL;
        uint64_t ts = 0, in_len = 0, out_len = 0;
        json_t *ids = NULL;
        const char *why = check_request(obj, &ts, &in_len, &out_len, &ids, &field);
        if (why) {
            if (field)
                trace_error(err, err_size, "%s:%llu: field \"%s\": %s", path,
                            (unsigned long long)line_no, field, why);
            else
                trace_error(err, err_size, "%s:%llu: %s", path, (unsigned long long)line_no, why);
            json_decref(obj);
            status = KM_ERR_PARSE;
            goto done;
        }
        if (t.n_requests > 0 && ts < t.requests[t.n_requests - 1].timestamp_ms) {
            trace_error(err, err_size, "%s:%llu: field \"timestamp\": %llu is before line %llu's %llu",
                        path, (unsigned long long)line_no, (unsigned long long)ts,
                        (unsigned long long)last_line,
                        (unsigned long long)t.requests[t.n_requests - 1].timestamp_ms);
            json_decref(obj);
            status = KM_ERR_PARSE;
            goto done;
        }
        size_t n_ids = json_array_size(ids);
        if (in_len == 0) {
            /* No prompt: an engine runs none, and every count of the run would disagree. */
            trace_error(err, err_size, "%s:%llu: field \"input_length\": 0 tokens, an engine "
                        "runs no empty prompt", path, (unsigned long long)line_no);
            json_decref(obj);
            status = KM_ERR_PARSE;
            goto done;
        }
        if (in_len > (uint64_t)n_ids * KM_TRACE_TOKENS_PER_ID) {
            trace_error(err, err_size, "%s:%llu: field \"input_length\": %llu tokens, more than "
                        "the %zu hash_ids cover (%u tokens each)", path,
                        (unsigned long long)line_no, (unsigned long long)in_len, n_ids,
                        KM_TRACE_TOKENS_PER_ID);
            json_decref(obj);
            status = KM_ERR_PARSE;
            goto done;
        }
        if (KM_ARRAY_GROW(t.requests, req_cap, t.n_requests + 1, 256) != KM_OK ||
            KM_ARRAY_GROW(offsets, offsets_cap, t.n_requests + 1, 256) != KM_OK ||
            KM_ARRAY_GROW(t.id_pool, pool_cap, t.n_ids + n_ids, 256) != KM_OK) {
            json_decref(obj);
            trace_error(err, err_size, "%s:%llu: out of memory", path, (unsigned long long)line_no);
            status = KM_ERR_OUT_OF_MEMORY;
            goto done;
        }
        for (size_t i = 0; i < n_ids; i++) {
            json_t *v = json_array_get(ids, i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                (uint64_t)json_integer_value(v) > UINT32_MAX) {
                trace_error(err, err_size, "%s:%llu: field \"hash_ids\": element %zu is not an "
                            "integer in [0, 2^32)", path, (unsigned long long)line_no, i);
                json_decref(obj);
                status = KM_ERR_PARSE;
                goto done;
            }
            t.id_pool[t.n_ids + i] = (uint32_t)json_integer_value(v);
        }
        json_decref(obj);
        km_trace_request *r = &t.requests[t.n_requests];
        r->timestamp_ms = ts;
        r->input_length = (uint32_t)in_len;
        r->output_length = (uint32_t)out_len;
        r->n_ids = (uint32_t)n_ids;
        r->ids = NULL;
        r->previous_turn = 0;
        r->answer_tokens = 0;
        offsets[t.n_requests] = t.n_ids;
        t.n_ids += n_ids;
        t.n_requests++;
        last_line = line_no;
    }
    if (ferror(f)) {
        trace_error(err, err_size, "%s: read error after line %llu: %s", path,
                    (unsigned long long)line_no, strerror(errno));
        status = KM_ERR_IO;
        goto done;
    }
    if (t.n_requests == 0) {
        trace_error(err, err_size, "%s: no requests (%llu lines)", path,
                    (unsigned long long)line_no);
        status = KM_ERR_PARSE;
        goto done;
    }
    for (size_t i = 0; i < t.n_requests; i++)
        t.requests[i].ids = t.id_pool + offsets[i];

done:
    free(line);
    free(offsets);
    fclose(f);
    if (status != KM_OK) {
        km_trace_free(&t);
        return status;
    }
    *out = t;
    return KM_OK;
}

void km_trace_free(km_trace *trace)
{
    if (!trace)
        return;
    free(trace->requests);
    free(trace->id_pool);
    memset(trace, 0, sizeof(*trace));
}

static inline uint64_t splitmix64(uint64_t x)
{
    uint64_t z = x + UINT64_C(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

void km_trace_id_tokens(uint32_t id, uint32_t tokens_per_id, uint32_t *tokens_out)
{
    if (!tokens_out)
        return;
    uint64_t base = (uint64_t)id << KM_TRACE_ID_SHIFT;
    for (uint32_t j = 0; j < tokens_per_id; j++)
        tokens_out[j] = (uint32_t)splitmix64(base + j);
}

/* Tokens a request expands into: its ids' tokens, truncated to input_length. */
static uint64_t request_tokens(const km_trace_request *r, uint32_t tokens_per_id)
{
    uint64_t from_ids = (uint64_t)r->n_ids * tokens_per_id;
    return from_ids < r->input_length ? from_ids : r->input_length;
}

uint32_t km_trace_max_blocks(const km_trace_request *r, uint32_t block_size, uint32_t tokens_per_id)
{
    if (!r || block_size == 0 || tokens_per_id == 0 || tokens_per_id > KM_TRACE_MAX_TOKENS_PER_ID)
        return 0;
    return (uint32_t)(request_tokens(r, tokens_per_id) / block_size);
}

int km_trace_chain_hashes(const km_trace_request *r, uint32_t block_size, uint32_t tokens_per_id,
                          uint64_t *out, uint32_t *n_out)
{
    if (!r || !out || !n_out || (r->n_ids > 0 && !r->ids))
        return KM_ERR_NULL_POINTER;
    *n_out = 0;
    if (block_size == 0)
        return KM_ERR_BLOCK_SIZE;
    if (tokens_per_id == 0 || tokens_per_id > KM_TRACE_MAX_TOKENS_PER_ID)
        return KM_ERR_INVALID_ARGUMENT;
    uint64_t n_tokens = request_tokens(r, tokens_per_id);
    uint64_t n_blocks = n_tokens / block_size;
    if (n_blocks == 0)
        return KM_OK;
    if (n_blocks > UINT32_MAX)
        return KM_ERR_TOO_LARGE;

    /* Expand and hash a whole number of blocks at a time, continuing the chain across chunks, so
     * scratch stays bounded however long the request is. */
    uint64_t chunk_blocks = KM_TRACE_CHUNK_TOKENS / block_size;
    if (chunk_blocks == 0)
        chunk_blocks = 1;
    if (chunk_blocks > n_blocks)
        chunk_blocks = n_blocks;
    uint32_t *tokens = malloc(chunk_blocks * block_size * sizeof(uint32_t));
    if (!tokens)
        return KM_ERR_OUT_OF_MEMORY;
    km_hash_config cfg = {.block_size = block_size, .lora_name = NULL, .cache_salt = NULL};
    uint64_t done = 0, parent = 0; /* ignored at position 0 */
    int status = KM_OK;
    while (done < n_blocks) {
        uint64_t blocks = n_blocks - done < chunk_blocks ? n_blocks - done : chunk_blocks;
        uint64_t first_token = done * block_size;
        for (uint64_t t = 0; t < blocks * block_size; t++) {
            uint64_t g = first_token + t;
            uint32_t id = r->ids[g / tokens_per_id];
            uint32_t j = (uint32_t)(g % tokens_per_id);
            tokens[t] = (uint32_t)splitmix64(((uint64_t)id << KM_TRACE_ID_SHIFT) + j);
        }
        size_t got = 0;
        status = km_hash_sequence(&cfg, tokens, (size_t)(blocks * block_size), done, parent, NULL,
                                  out + done, &got);
        if (status != KM_OK)
            break;
        if (got != blocks) {
            status = KM_ERR_INTERNAL;
            break;
        }
        done += blocks;
        parent = out[done - 1];
    }
    free(tokens);
    if (status == KM_OK)
        *n_out = (uint32_t)n_blocks;
    return status;
}
