/* SPDX-License-Identifier: Apache-2.0 */
/* Linked decision and outcome records (include/kvmatch/records.h): formatting round trips on random
 * records (every field parsed back with jansson and compared, nulls and escapes included), a
 * decision whose best match is on A while B is chosen (both in the record), every bad field
 * rejected with a code and a sentence naming it, every line validated by tests/check_records.py
 * against docs/records.schema.json, and the background writer: concurrent submitters, a full
 * queue that drops instead of blocking (a FIFO nobody reads), rotation by size, unwritable paths
 * and a full disk that are counted while the writer keeps running, a partial last line from a
 * crash.
 * Randomized tests print their seed (KM_TEST_SEED). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <jansson.h>

#include "kvmatch/records.h"
#include "test_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static void make_temp_dir(char dir[64])
{
    snprintf(dir, 64, "/tmp/km-records-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
}

static void remove_dir(const char *dir)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    int rc = system(cmd);
    (void)rc;
}

/* The whole file, NUL-terminated (NULL when it does not exist). */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *data = malloc(cap);
    cr_assert(data);
    for (;;) {
        if (n + 4096 > cap) {
            cap *= 2;
            data = realloc(data, cap);
            cr_assert(data);
        }
        size_t got = fread(data + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    data[n] = '\0';
    if (len)
        *len = n;
    return data;
}

/* ---- random records -------------------------------------------------------------------------- */

/* Pieces that exercise JSON escaping: quotes, backslashes, newlines, tabs, control characters,
 * 2-, 3- and 4-byte UTF-8, a script tag, and nothing at all. */
static const char *const PIECES[] = {
    "req-",     "\"quoted\"", "line\nbreak", "back\\slash", "tab\there", "\x01\x1f",
    "caf\xc3\xa9", "\xe6\x97\xa5\xe6\x9c\xac", "\xf0\x9f\x98\x80", "</script>", "", "a/b",
    "{\"json\":1}", "\r\n",
};
#define N_PIECES (sizeof PIECES / sizeof PIECES[0])

typedef struct gen {
    km_rng rng;
    char strings[48][96];
    int used;
    km_record_candidate candidates[12];
} gen;

/* A copy of s in the generator's strings (NULL stays NULL). */
static const char *in_strings(gen *g, const char *s)
{
    if (!s)
        return NULL;
    cr_assert(g->used < 48);
    char *d = g->strings[g->used++];
    snprintf(d, sizeof g->strings[0], "%s", s);
    return d;
}

static const char *gen_string(gen *g)
{
    cr_assert(g->used < 48);
    char *s = g->strings[g->used++];
    s[0] = '\0';
    uint32_t n = km_rng_below(&g->rng, 5);
    for (uint32_t i = 0; i < n; i++)
        strcat(s, PIECES[km_rng_below(&g->rng, N_PIECES)]);
    char tail[24];
    snprintf(tail, sizeof tail, "%u", km_rng_below(&g->rng, 1000));
    strcat(s, tail);
    return s;
}

static const char *gen_optional_string(gen *g)
{
    return km_rng_percent(&g->rng, 30) ? NULL : gen_string(g);
}

static int64_t gen_count(gen *g, bool optional)
{
    if (optional && km_rng_percent(&g->rng, 30))
        return KM_RECORD_ABSENT;
    switch (km_rng_below(&g->rng, 4)) {
    case 0: return 0;
    case 1: return km_rng_below(&g->rng, 100);
    case 2: return (int64_t)(km_rng_next(&g->rng) >> 12); /* large, < 2^52 */
    default: return (int64_t)km_rng_below(&g->rng, 1u << 20);
    }
}

static double gen_real(gen *g)
{
    switch (km_rng_below(&g->rng, 5)) {
    case 0: return NAN;
    case 1: return 0.0;
    case 2: return (double)km_rng_below(&g->rng, 1000);
    case 3: return -1.0 / (1 + km_rng_below(&g->rng, 7));
    default: return (double)(km_rng_next(&g->rng) >> 11) / 9007199254740992.0 * 1e6;
    }
}

static const char *const STATES[] = {"LIVE", "GAP", "SYNCING", "DEGRADED", "APPROX"};
static const char *const POLICIES[] = {"kv", "cache_aware", "prefix", "least_load", "round_robin"};
static const char *const LOAD_KINDS[] = {"in_flight", "pending_prefill_tokens", "active_decode_blocks",
                                         "kv_cost"};
static const char *const WORKERS[] = {"w0", "w1", "worker \"two\"", "http://10.0.0.3:8000", "w\n4"};

static km_record_time gen_time(gen *g, bool optional)
{
    km_record_time t = {KM_RECORD_ABSENT, KM_RECORD_ABSENT};
    if (optional && km_rng_percent(&g->rng, 25))
        return t;
    /* 1970 .. ~2200, with arbitrary nanoseconds */
    t.wall_ns = (int64_t)(km_rng_next(&g->rng) % UINT64_C(7258118400000000000));
    t.monotonic_ns = (int64_t)(km_rng_next(&g->rng) >> 2);
    if (optional && km_rng_percent(&g->rng, 10))
        t.wall_ns = KM_RECORD_ABSENT;
    return t;
}

static void gen_common(gen *g, km_record_common *c)
{
    c->record_id = gen_count(g, false);
    c->instance = gen_string(g);
    c->host = gen_optional_string(g);
    c->kvmatch_version = "0.1.0";
    c->decision_id = gen_count(g, false);
    c->request_id = gen_string(g);
    c->attempt_id = gen_string(g);
    c->model = gen_string(g);
    c->pool = gen_string(g);
    c->endpoint = gen_optional_string(g);
    c->time = gen_time(g, false);
}

static void gen_decision(gen *g, km_decision_record *r)
{
    g->used = 0;
    km_decision_record_init(r);
    gen_common(g, &r->common);
    r->source = km_rng_percent(&g->rng, 50) ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
    r->input = km_rng_percent(&g->rng, 50) ? KM_RECORD_INPUT_TOKENS : KM_RECORD_INPUT_HASHES;
    r->block_size = 1 + km_rng_below(&g->rng, 64);
    r->block_count = km_rng_below(&g->rng, 5000);
    r->prompt_tokens = gen_count(g, true);
    r->expected_output_tokens = gen_count(g, true);
    r->scored_monotonic_ns = gen_count(g, true);
    if (km_rng_percent(&g->rng, 20)) {
        r->owner.worker = NULL; /* nobody holds any block */
        r->owner.state = NULL;
        r->owner.depth_blocks = 0;
    } else {
        r->owner.worker = WORKERS[km_rng_below(&g->rng, 5)];
        r->owner.state = STATES[km_rng_below(&g->rng, 5)];
        r->owner.depth_blocks = km_rng_below(&g->rng, 5000);
    }
    r->chosen.worker = WORKERS[km_rng_below(&g->rng, 5)];
    r->chosen.state = STATES[km_rng_below(&g->rng, 5)];
    r->chosen.depth_blocks = km_rng_below(&g->rng, 5000);
    r->policy = POLICIES[km_rng_below(&g->rng, 5)];
    r->reason = gen_optional_string(g);
    r->load_kind = LOAD_KINDS[km_rng_below(&g->rng, 4)];
    r->load_value = gen_real(g);
    r->predicted_ttft_ms = gen_real(g);
    if (r->predicted_ttft_ms < 0)
        r->predicted_ttft_ms = -r->predicted_ttft_ms;
    r->n_candidates = km_rng_below(&g->rng, 13);
    for (size_t i = 0; i < r->n_candidates; i++) {
        km_record_candidate *c = &g->candidates[i];
        km_record_candidate_init(c);
        c->worker = WORKERS[km_rng_below(&g->rng, 5)];
        c->state = STATES[km_rng_below(&g->rng, 5)];
        c->depth_blocks = km_rng_below(&g->rng, 5000);
        c->device_blocks = gen_count(g, true);
        c->host_blocks = gen_count(g, true);
        c->disk_blocks = gen_count(g, true);
        c->in_flight = gen_count(g, true);
        c->pending_prefill_tokens = gen_count(g, true);
        c->active_decode_blocks = gen_count(g, true);
        c->queued_depth_blocks = gen_count(g, true);
        c->last_arrival = gen_count(g, true);
        c->cost = gen_real(g);
        c->eligible = km_rng_percent(&g->rng, 80);
    }
    r->candidates = r->n_candidates ? g->candidates : (km_rng_percent(&g->rng, 50) ? NULL : g->candidates);
    if (km_rng_percent(&g->rng, 30)) {
        r->warm_up.worker = WORKERS[km_rng_below(&g->rng, 5)];
        r->warm_up.blocks = km_rng_below(&g->rng, 5000);
        r->warm_up.decision_id = gen_count(g, false);
    } else if (km_rng_percent(&g->rng, 30)) {
        r->warm_up_for = gen_count(g, false);
    }
}

static void gen_outcome(gen *g, km_outcome_record *r)
{
    g->used = 0;
    km_outcome_record_init(r);
    gen_common(g, &r->common);
    r->outcome = (km_record_outcome)(1 + km_rng_below(&g->rng, 5));
    r->finish_reason = gen_optional_string(g);
    r->done_seen = (km_record_flag)km_rng_below(&g->rng, 3);
    r->http_status = km_rng_percent(&g->rng, 30) ? KM_RECORD_ABSENT : km_rng_below(&g->rng, 1000);
    r->error = gen_optional_string(g);
    r->cached_tokens = gen_count(g, true);
    r->prompt_tokens = gen_count(g, true);
    r->output_tokens = gen_count(g, true);
    r->retries = gen_count(g, true);
    r->decided = gen_time(g, true);
    r->dispatched = gen_time(g, true);
    r->first_token = gen_time(g, true);
    r->finished = gen_time(g, true);
    r->router_dispatched_ms = fabs(gen_real(g)); /* durations: NAN (null) or >= 0 */
    r->router_ttft_ms = fabs(gen_real(g));
    r->router_e2e_ms = fabs(gen_real(g));
    /* monotonic order after the decision, so the derived durations are defined */
    if (r->decided.monotonic_ns != KM_RECORD_ABSENT) {
        int64_t base = r->decided.monotonic_ns / 2;
        r->decided.monotonic_ns = base;
        if (r->dispatched.monotonic_ns != KM_RECORD_ABSENT)
            r->dispatched.monotonic_ns = base + km_rng_below(&g->rng, 1000000);
        if (r->first_token.monotonic_ns != KM_RECORD_ABSENT)
            r->first_token.monotonic_ns = base + km_rng_below(&g->rng, 100000000);
    }
    r->worker = WORKERS[km_rng_below(&g->rng, 5)];
    r->dispatched_worker = km_rng_percent(&g->rng, 20) ? WORKERS[km_rng_below(&g->rng, 5)] : NULL;
    r->source = km_rng_percent(&g->rng, 50) ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
    r->block_size = 1 + km_rng_below(&g->rng, 64);
    r->predicted_depth_blocks = km_rng_below(&g->rng, 5000);
    r->owner_worker = km_rng_percent(&g->rng, 20) ? NULL : WORKERS[km_rng_below(&g->rng, 5)];
    r->owner_depth_blocks = r->owner_worker ? km_rng_below(&g->rng, 5000) : 0;
}

/* ---- field comparison ------------------------------------------------------------------------ */

static json_t *member(json_t *obj, const char *key)
{
    cr_assert(json_is_object(obj), "expected an object holding %s", key);
    json_t *v = json_object_get(obj, key);
    KM_CHECK(v != NULL, "field %s is missing", key);
    return v;
}

static void expect_string(json_t *obj, const char *key, const char *expect)
{
    json_t *v = member(obj, key);
    if (!expect) {
        KM_CHECK(json_is_null(v), "field %s: expected null", key);
        return;
    }
    KM_CHECK(json_is_string(v), "field %s: expected a string", key);
    KM_CHECK(json_string_length(v) == strlen(expect) && strcmp(json_string_value(v), expect) == 0,
             "field %s: got \"%s\", expected \"%s\"", key, json_string_value(v), expect);
}

static void expect_int(json_t *obj, const char *key, int64_t expect)
{
    json_t *v = member(obj, key);
    if (expect == KM_RECORD_ABSENT) {
        KM_CHECK(json_is_null(v), "field %s: expected null (absent is not 0)", key);
        return;
    }
    KM_CHECK(json_is_integer(v), "field %s: expected an integer", key);
    KM_CHECK((int64_t)json_integer_value(v) == expect, "field %s: got %" PRId64 ", expected %" PRId64,
             key, (int64_t)json_integer_value(v), expect);
}

static void expect_real(json_t *obj, const char *key, double expect)
{
    json_t *v = member(obj, key);
    if (isnan(expect)) {
        KM_CHECK(json_is_null(v), "field %s: expected null", key);
        return;
    }
    KM_CHECK(json_is_number(v), "field %s: expected a number", key);
    /* reals are written with 16 significant digits */
    KM_CHECK(fabs(json_number_value(v) - expect) <= 1e-15 * fabs(expect), "field %s: got %.17g, expected %.17g",
             key, json_number_value(v), expect);
}

static void expect_tokens(json_t *obj, const char *key, int64_t blocks, int64_t block_size)
{
    expect_int(obj, key, blocks == KM_RECORD_ABSENT ? KM_RECORD_ABSENT : blocks * block_size);
}

/* An independent RFC 3339 rendering: days from the civil calendar algorithm (H. Hinnant), not
 * gmtime, so the formatter is checked against a second implementation. */
static void rfc3339(int64_t wall_ns, char out[64])
{
    int64_t secs = wall_ns / 1000000000, micros = (wall_ns % 1000000000) / 1000;
    int64_t days = secs / 86400, rem = secs % 86400;
    int64_t z = days + 719468, era = z / 146097, doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t y = yoe + era * 400, doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153, d = doy - (153 * mp + 2) / 5 + 1;
    int64_t m = mp < 10 ? mp + 3 : mp - 9;
    if (m <= 2)
        y++;
    snprintf(out, 64, "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ", (int)y, (int)m, (int)d,
             (int)(rem / 3600), (int)(rem / 60 % 60), (int)(rem % 60), (int)micros);
}

static void expect_wall(json_t *obj, const char *key, int64_t wall_ns)
{
    if (wall_ns == KM_RECORD_ABSENT) {
        expect_string(obj, key, NULL);
        return;
    }
    char text[64];
    rfc3339(wall_ns, text);
    expect_string(obj, key, text);
}

static void expect_time(json_t *obj, const char *prefix, km_record_time t)
{
    char wall[64], mono[64];
    snprintf(wall, sizeof wall, "%s_time", prefix);
    snprintf(mono, sizeof mono, "%s_monotonic_ns", prefix);
    expect_wall(obj, wall, t.wall_ns);
    expect_int(obj, mono, t.monotonic_ns);
}

static void expect_keys(json_t *obj, size_t n)
{
    KM_CHECK(json_object_size(obj) == n, "object has %zu fields, expected %zu",
             json_object_size(obj), n);
}

static void expect_common(json_t *o, const char *type, const km_record_common *c)
{
    expect_string(o, "type", type);
    expect_int(o, "schema_version", KM_RECORD_SCHEMA_VERSION);
    expect_int(o, "record_id", c->record_id);
    expect_string(o, "instance", c->instance);
    expect_string(o, "host", c->host);
    expect_string(o, "kvmatch_version", c->kvmatch_version);
    expect_int(o, "decision_id", c->decision_id);
    expect_string(o, "request_id", c->request_id);
    expect_string(o, "attempt_id", c->attempt_id);
    expect_string(o, "model", c->model);
    expect_string(o, "pool", c->pool);
    expect_string(o, "endpoint", c->endpoint);
    expect_wall(o, "time", c->time.wall_ns);
    expect_int(o, "monotonic_ns", c->time.monotonic_ns);
}
#define COMMON_KEYS 14u

static void expect_worker(json_t *o, const km_record_worker *w, int64_t block_size)
{
    expect_keys(o, 4);
    expect_string(o, "worker", w->worker);
    expect_string(o, "state", w->state);
    expect_int(o, "depth_blocks", w->depth_blocks);
    expect_tokens(o, "depth_tokens", w->depth_blocks, block_size);
}

/* Parse a formatted line back and compare every field with the record it came from. */
static void check_decision_line(const char *line, size_t len, const km_decision_record *r)
{
    KM_CHECK(len == strlen(line), "length %zu, strlen %zu", len, strlen(line));
    KM_CHECK(memchr(line, '\n', len) == NULL, "a newline inside the line: %s", line);
    json_error_t err;
    json_t *o = json_loadb(line, len, 0, &err);
    KM_CHECK(o != NULL, "not JSON (%s): %s", err.text, line);
    expect_keys(o, COMMON_KEYS + 3);
    expect_common(o, "decision", &r->common);

    json_t *p = member(o, "prediction");
    expect_keys(p, 9);
    expect_string(p, "source", r->source == KM_RECORD_SOURCE_EVENTS ? "events" : "approx");
    expect_string(p, "input", r->input == KM_RECORD_INPUT_TOKENS ? "tokens" : "hashes");
    expect_string(p, "units", "blocks");
    expect_int(p, "block_size", r->block_size);
    expect_int(p, "block_count", r->block_count);
    expect_int(p, "prompt_tokens", r->prompt_tokens);
    expect_int(p, "expected_output_tokens", r->expected_output_tokens);
    expect_int(p, "scored_monotonic_ns", r->scored_monotonic_ns);
    expect_worker(member(p, "owner"), &r->owner, r->block_size);

    json_t *d = member(o, "decision");
    expect_keys(d, 8);
    expect_real(d, "predicted_ttft_ms", r->predicted_ttft_ms);
    expect_string(d, "policy", r->policy);
    expect_string(d, "reason", r->reason);
    expect_worker(member(d, "chosen"), &r->chosen, r->block_size);
    bool same = r->owner.worker && strcmp(r->owner.worker, r->chosen.worker) == 0;
    KM_CHECK(json_is_boolean(member(d, "owner_is_chosen")) &&
                 json_is_true(member(d, "owner_is_chosen")) == same,
             "owner_is_chosen should be %d", same);
    json_t *load = member(d, "load");
    expect_keys(load, 3);
    expect_string(load, "kind", r->load_kind);
    expect_real(load, "value", r->load_value);
    expect_string(load, "scope", "this_instance");
    json_t *warm = member(d, "warm_up");
    if (!r->warm_up.worker) {
        KM_CHECK(json_is_null(warm), "warm_up should be null");
    } else {
        expect_keys(warm, 4);
        expect_string(warm, "worker", r->warm_up.worker);
        expect_int(warm, "blocks", r->warm_up.blocks);
        expect_tokens(warm, "tokens", r->warm_up.blocks, r->block_size);
        expect_int(warm, "decision_id", r->warm_up.decision_id);
    }
    expect_int(d, "warm_up_for", r->warm_up_for);

    json_t *cs = member(o, "candidates");
    KM_CHECK(json_is_array(cs) && json_array_size(cs) == r->n_candidates, "candidates: %zu, expected %zu",
             json_array_size(cs), r->n_candidates);
    for (size_t i = 0; i < r->n_candidates; i++) {
        const km_record_candidate *c = &r->candidates[i];
        json_t *j = json_array_get(cs, i);
        expect_keys(j, 14);
        expect_string(j, "worker", c->worker);
        expect_string(j, "state", c->state);
        expect_int(j, "depth_blocks", c->depth_blocks);
        expect_tokens(j, "depth_tokens", c->depth_blocks, r->block_size);
        expect_int(j, "device_blocks", c->device_blocks);
        expect_int(j, "host_blocks", c->host_blocks);
        expect_int(j, "disk_blocks", c->disk_blocks);
        expect_int(j, "in_flight", c->in_flight);
        expect_int(j, "pending_prefill_tokens", c->pending_prefill_tokens);
        expect_int(j, "active_decode_blocks", c->active_decode_blocks);
        expect_int(j, "queued_depth_blocks", c->queued_depth_blocks);
        expect_int(j, "last_arrival", c->last_arrival);
        expect_real(j, "cost", c->cost);
        KM_CHECK(json_is_boolean(member(j, "eligible")) &&
                     json_is_true(member(j, "eligible")) == c->eligible,
                 "candidates[%zu].eligible", i);
    }
    json_decref(o);
}

static void check_outcome_line(const char *line, size_t len, const km_outcome_record *r)
{
    KM_CHECK(len == strlen(line) && memchr(line, '\n', len) == NULL, "bad line: %s", line);
    json_error_t err;
    json_t *o = json_loadb(line, len, 0, &err);
    KM_CHECK(o != NULL, "not JSON (%s): %s", err.text, line);
    expect_keys(o, COMMON_KEYS + 25);
    expect_common(o, "outcome", &r->common);
    expect_string(o, "outcome", km_record_outcome_name(r->outcome));
    expect_string(o, "finish_reason", r->finish_reason);
    json_t *done = member(o, "done_seen");
    switch (r->done_seen) {
    case KM_RECORD_FLAG_UNKNOWN: KM_CHECK(json_is_null(done), "done_seen should be null"); break;
    case KM_RECORD_FLAG_FALSE: KM_CHECK(json_is_false(done), "done_seen should be false"); break;
    case KM_RECORD_FLAG_TRUE: KM_CHECK(json_is_true(done), "done_seen should be true"); break;
    }
    expect_int(o, "http_status", r->http_status);
    expect_string(o, "error", r->error);
    expect_string(o, "worker", r->worker);
    expect_string(o, "dispatched_worker", r->dispatched_worker);
    expect_int(o, "cached_tokens", r->cached_tokens);
    expect_int(o, "prompt_tokens", r->prompt_tokens);
    expect_int(o, "output_tokens", r->output_tokens);
    expect_int(o, "retries", r->retries);
    expect_time(o, "decided", r->decided);
    expect_time(o, "dispatched", r->dispatched);
    expect_time(o, "first_token", r->first_token);
    expect_time(o, "finished", r->finished);
    int64_t d0 = r->decided.monotonic_ns, d1 = r->dispatched.monotonic_ns, d2 = r->first_token.monotonic_ns;
    expect_int(o, "wait_ns", d0 == KM_RECORD_ABSENT || d1 == KM_RECORD_ABSENT ? KM_RECORD_ABSENT : d1 - d0);
    expect_int(o, "ttft_ns", d0 == KM_RECORD_ABSENT || d2 == KM_RECORD_ABSENT ? KM_RECORD_ABSENT : d2 - d0);
    expect_real(o, "router_dispatched_ms", r->router_dispatched_ms);
    expect_real(o, "router_ttft_ms", r->router_ttft_ms);
    expect_real(o, "router_e2e_ms", r->router_e2e_ms);
    json_t *p = member(o, "predicted");
    expect_keys(p, 8);
    expect_string(p, "source", km_record_source_name(r->source));
    expect_string(p, "units", "blocks");
    expect_int(p, "block_size", r->block_size);
    expect_int(p, "depth_blocks", r->predicted_depth_blocks);
    expect_tokens(p, "depth_tokens", r->predicted_depth_blocks, r->block_size);
    expect_string(p, "owner_worker", r->owner_worker);
    expect_int(p, "owner_depth_blocks", r->owner_depth_blocks);
    expect_tokens(p, "owner_depth_tokens", r->owner_depth_blocks, r->block_size);
    json_decref(o);
}

/* A minimal valid decision: the best match on A under the threshold, B chosen. */
static void owner_elsewhere_case(km_decision_record *r, km_record_candidate cands[2])
{
    km_decision_record_init(r);
    r->common.record_id = 1;
    r->common.instance = "0123456789abcdef0123456789abcdef";
    r->common.host = "router-host-1";
    r->common.kvmatch_version = "0.1.0";
    r->common.decision_id = 7;
    r->common.request_id = "req-1";
    r->common.attempt_id = "req-1/0";
    r->common.model = "llama";
    r->common.pool = "default";
    r->common.endpoint = "/v1/chat/completions";
    r->common.time.wall_ns = INT64_C(1796000000123456789);
    r->common.time.monotonic_ns = 5000000000;
    r->source = KM_RECORD_SOURCE_EVENTS;
    r->input = KM_RECORD_INPUT_TOKENS;
    r->block_size = 16;
    r->block_count = 40;
    r->prompt_tokens = 650;
    r->owner = (km_record_worker){"A", "LIVE", 12};
    r->chosen = (km_record_worker){"B", "LIVE", 0};
    r->policy = "cache_aware";
    r->reason = "below_cache_threshold";
    r->load_kind = "in_flight";
    r->load_value = 1;
    km_record_candidate_init(&cands[0]);
    km_record_candidate_init(&cands[1]);
    cands[0].worker = "A";
    cands[0].state = "LIVE";
    cands[0].depth_blocks = 12;
    cands[0].device_blocks = 12;
    cands[0].in_flight = 9;
    cands[1].worker = "B";
    cands[1].state = "LIVE";
    cands[1].depth_blocks = 0;
    cands[1].device_blocks = 0;
    cands[1].in_flight = 1;
    r->candidates = cands;
    r->n_candidates = 2;
}

/* ---- formatting ------------------------------------------------------------------------------ */

Test(records, decision_round_trip_random, .timeout = 60)
{
    gen g;
    km_rng_init(&g.rng, km_test_seed());
    for (int i = 0; i < 2000; i++) {
        km_decision_record r;
        gen_decision(&g, &r);
        char *line = NULL, error[256];
        size_t len = 0;
        int rc = km_decision_record_format(&r, &line, &len, error, sizeof error);
        KM_CHECK(rc == KM_OK, "record %d: %s", i, error);
        check_decision_line(line, len, &r);
        free(line);
    }
}

Test(records, outcome_round_trip_random, .timeout = 60)
{
    gen g;
    km_rng_init(&g.rng, km_test_seed() ^ 0x5555);
    for (int i = 0; i < 2000; i++) {
        km_outcome_record r;
        gen_outcome(&g, &r);
        char *line = NULL, error[256];
        size_t len = 0;
        int rc = km_outcome_record_format(&r, &line, &len, error, sizeof error);
        KM_CHECK(rc == KM_OK, "record %d: %s", i, error);
        check_outcome_line(line, len, &r);
        free(line);
    }
}

Test(records, a_decision_away_from_its_owner_keeps_both_apart, .timeout = 10)
{
    km_decision_record d;
    km_record_candidate cands[2];
    owner_elsewhere_case(&d, cands);
    char *line;
    size_t len;
    char error[256];
    cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s", error);
    check_decision_line(line, len, &d);
    json_t *o = json_loads(line, 0, NULL);
    json_t *owner = json_object_get(json_object_get(o, "prediction"), "owner");
    json_t *chosen = json_object_get(json_object_get(o, "decision"), "chosen");
    cr_assert_str_eq(json_string_value(json_object_get(owner, "worker")), "A");
    cr_assert_eq(json_integer_value(json_object_get(owner, "depth_tokens")), 192);
    cr_assert_str_eq(json_string_value(json_object_get(chosen, "worker")), "B");
    cr_assert_eq(json_integer_value(json_object_get(chosen, "depth_blocks")), 0);
    cr_assert(json_is_false(json_object_get(json_object_get(o, "decision"), "owner_is_chosen")));
    cr_assert_str_eq(json_string_value(json_object_get(o, "time")), "2026-11-30T00:53:20.123456Z");
    json_decref(o);
    free(line);

    /* the outcome copies the prediction: B was predicted 0 blocks, A owned 12, engine says 0 */
    km_outcome_record out;
    km_outcome_record_init(&out);
    km_outcome_record_from_decision(&out, &d);
    out.common.record_id = 2;
    out.common.time = km_record_time_now();
    out.outcome = KM_RECORD_OUTCOME_COMPLETE;
    out.finish_reason = "stop";
    out.done_seen = KM_RECORD_FLAG_TRUE;
    out.http_status = 200;
    out.cached_tokens = 0;
    cr_assert_eq(km_outcome_record_format(&out, &line, &len, error, sizeof error), KM_OK, "%s", error);
    check_outcome_line(line, len, &out);
    o = json_loads(line, 0, NULL);
    json_t *p = json_object_get(o, "predicted");
    cr_assert_str_eq(json_string_value(json_object_get(o, "worker")), "B");
    cr_assert_str_eq(json_string_value(json_object_get(p, "owner_worker")), "A");
    cr_assert_eq(json_integer_value(json_object_get(p, "owner_depth_blocks")), 12);
    cr_assert_eq(json_integer_value(json_object_get(p, "depth_blocks")), 0);
    cr_assert_eq(json_integer_value(json_object_get(o, "decision_id")), 7);
    cr_assert(json_is_integer(json_object_get(o, "cached_tokens"))); /* reported 0, not null */
    cr_assert(json_is_null(json_object_get(o, "wait_ns"))); /* no DISPATCHED */
    json_decref(o);
    free(line);
}

Test(records, absent_values_are_null_never_zero, .timeout = 10)
{
    km_outcome_record r;
    km_outcome_record_init(&r);
    r.common.instance = "i";
    r.common.kvmatch_version = "v";
    r.common.request_id = "r";
    r.common.attempt_id = "a";
    r.common.model = "m";
    r.common.pool = "p";
    r.common.time.wall_ns = 0; /* the epoch itself is a valid time */
    r.common.time.monotonic_ns = 0;
    r.outcome = KM_RECORD_OUTCOME_EXPIRED;
    r.worker = "w";
    r.source = KM_RECORD_SOURCE_APPROX;
    r.block_size = 1;
    char *line;
    size_t len;
    char error[256];
    cr_assert_eq(km_outcome_record_format(&r, &line, &len, error, sizeof error), KM_OK, "%s", error);
    json_t *o = json_loads(line, 0, NULL);
    const char *nulls[] = {"host", "endpoint", "finish_reason", "done_seen", "http_status", "error",
                           "cached_tokens", "prompt_tokens", "output_tokens", "retries",
                           "decided_time", "decided_monotonic_ns", "dispatched_time",
                           "dispatched_monotonic_ns", "first_token_time", "first_token_monotonic_ns",
                           "finished_time", "finished_monotonic_ns", "wait_ns", "ttft_ns",
                           "router_dispatched_ms", "router_ttft_ms", "router_e2e_ms"};
    for (size_t i = 0; i < sizeof nulls / sizeof nulls[0]; i++)
        cr_assert(json_is_null(json_object_get(o, nulls[i])), "%s should be null: %s", nulls[i], line);
    cr_assert_str_eq(json_string_value(json_object_get(o, "time")), "1970-01-01T00:00:00.000000Z");
    cr_assert_str_eq(json_string_value(json_object_get(o, "outcome")), "expired");
    cr_assert(json_is_null(json_object_get(json_object_get(o, "predicted"), "owner_worker")));
    json_decref(o);
    free(line);

    km_decision_record d;
    km_record_candidate c[2];
    owner_elsewhere_case(&d, c);
    d.prompt_tokens = KM_RECORD_ABSENT;
    d.load_value = NAN;
    d.owner = (km_record_worker){NULL, NULL, 0};
    cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s", error);
    o = json_loads(line, 0, NULL);
    json_t *p = json_object_get(o, "prediction");
    cr_assert(json_is_null(json_object_get(p, "prompt_tokens")));
    cr_assert(json_is_null(json_object_get(p, "expected_output_tokens")));
    cr_assert(json_is_null(json_object_get(json_object_get(p, "owner"), "worker")));
    cr_assert(json_is_null(json_object_get(json_object_get(p, "owner"), "state")));
    cr_assert(json_is_null(json_object_get(json_object_get(json_object_get(o, "decision"), "load"),
                                           "value")));
    cr_assert(json_is_null(json_object_get(json_object_get(o, "decision"), "predicted_ttft_ms")),
              "%s", line);
    json_t *cand = json_array_get(json_object_get(o, "candidates"), 0);
    cr_assert(json_is_null(json_object_get(cand, "host_blocks")));
    cr_assert(json_is_null(json_object_get(cand, "cost")));
    cr_assert(json_is_null(json_object_get(cand, "pending_prefill_tokens")));
    cr_assert_eq(json_integer_value(json_object_get(cand, "device_blocks")), 12);
    json_decref(o);
    free(line);
}

/* Every bad field: the named code, no line, and a sentence naming the field. */
typedef struct bad_case {
    const char *name;
    int status;
    const char *mention;
} bad_case;

static void expect_decision_error(const km_decision_record *r, int status, const char *mention)
{
    char *line = (char *)1;
    size_t len = 99;
    char error[256];
    int rc = km_decision_record_format(r, &line, &len, error, sizeof error);
    cr_assert_eq(rc, status, "expected %s, got %s (%s)", km_error_name(status), km_error_name(rc), error);
    cr_assert_null(line);
    cr_assert_eq(len, 0);
    cr_assert(strstr(error, km_error_name(status)) != NULL, "message \"%s\" lacks the code", error);
    cr_assert(strstr(error, mention) != NULL, "message \"%s\" does not mention %s", error, mention);
}

static void expect_outcome_error(const km_outcome_record *r, int status, const char *mention)
{
    char *line = (char *)1;
    size_t len = 99;
    char error[256];
    int rc = km_outcome_record_format(r, &line, &len, error, sizeof error);
    cr_assert_eq(rc, status, "expected %s, got %s (%s)", km_error_name(status), km_error_name(rc), error);
    cr_assert_null(line);
    cr_assert(strstr(error, mention) != NULL, "message \"%s\" does not mention %s", error, mention);
}

Test(records, bad_decision_fields_are_rejected_by_name, .timeout = 10)
{
    km_decision_record d;
    km_record_candidate c[2];
    char *line;
    size_t len;
    char error[128];
    cr_assert_eq(km_decision_record_format(NULL, &line, &len, error, sizeof error), KM_ERR_NULL_POINTER);
    owner_elsewhere_case(&d, c);
    cr_assert_eq(km_decision_record_format(&d, NULL, &len, error, sizeof error), KM_ERR_NULL_POINTER);
    /* a NULL error buffer is allowed */
    cr_assert_eq(km_decision_record_format(&d, &line, &len, NULL, 0), KM_OK);
    free(line);

#define CASE(mutation, status, mention)                                                          \
    do {                                                                                          \
        owner_elsewhere_case(&d, c);                                                             \
        mutation;                                                                                 \
        expect_decision_error(&d, status, mention);                                              \
    } while (0)
    CASE(d.common.request_id = NULL, KM_ERR_NULL_POINTER, "request_id");
    CASE(d.common.instance = NULL, KM_ERR_NULL_POINTER, "instance");
    CASE(d.common.attempt_id = "bad \xff utf-8", KM_ERR_INVALID_ARGUMENT, "attempt_id");
    CASE(d.common.model = "\xc3", KM_ERR_INVALID_ARGUMENT, "model");
    CASE(d.common.record_id = -5, KM_ERR_INVALID_ARGUMENT, "record_id");
    CASE(d.common.decision_id = KM_RECORD_ABSENT, KM_ERR_INVALID_ARGUMENT, "decision_id");
    CASE(d.common.time.wall_ns = KM_RECORD_ABSENT, KM_ERR_INVALID_ARGUMENT, "time");
    CASE(d.common.time.wall_ns = -1, KM_ERR_INVALID_ARGUMENT, "time");
    CASE(d.common.time.monotonic_ns = KM_RECORD_ABSENT, KM_ERR_INVALID_ARGUMENT, "monotonic_ns");
    CASE(d.source = 0, KM_ERR_INVALID_ARGUMENT, "source");
    CASE(d.source = 3, KM_ERR_INVALID_ARGUMENT, "source");
    CASE(d.input = 7, KM_ERR_INVALID_ARGUMENT, "input");
    CASE(d.block_size = 0, KM_ERR_INVALID_ARGUMENT, "block_size");
    CASE(d.block_count = -1, KM_ERR_INVALID_ARGUMENT, "block_count");
    CASE(d.prompt_tokens = -3, KM_ERR_INVALID_ARGUMENT, "prompt_tokens");
    CASE(d.owner.depth_blocks = -2, KM_ERR_INVALID_ARGUMENT, "prediction.owner");
    CASE(d.owner.state = "live", KM_ERR_INVALID_ARGUMENT, "state");
    CASE(d.owner.state = NULL, KM_ERR_NULL_POINTER, "prediction.owner");
    CASE(d.chosen.worker = NULL, KM_ERR_NULL_POINTER, "decision.chosen");
    CASE(d.chosen.state = "", KM_ERR_INVALID_ARGUMENT, "state");
    CASE(d.chosen.depth_blocks = INT64_MAX / 2, KM_ERR_INVALID_ARGUMENT, "depth_tokens");
    CASE(d.policy = NULL, KM_ERR_NULL_POINTER, "policy");
    CASE(d.policy = "Cache-Aware", KM_ERR_INVALID_ARGUMENT, "policy");
    CASE(d.load_kind = NULL, KM_ERR_NULL_POINTER, "kind");
    CASE(d.load_value = INFINITY, KM_ERR_INVALID_ARGUMENT, "value");
    CASE(d.predicted_ttft_ms = -0.5, KM_ERR_INVALID_ARGUMENT, "predicted_ttft_ms");
    CASE(d.predicted_ttft_ms = INFINITY, KM_ERR_INVALID_ARGUMENT, "predicted_ttft_ms");
    CASE(c[1].worker = NULL, KM_ERR_NULL_POINTER, "candidates[1]");
    CASE(c[0].state = NULL, KM_ERR_NULL_POINTER, "candidates[0]");
    CASE(c[1].cost = -INFINITY, KM_ERR_INVALID_ARGUMENT, "candidates[1]");
    CASE(c[1].in_flight = -1, KM_ERR_INVALID_ARGUMENT, "in_flight");
    CASE(d.candidates = NULL, KM_ERR_NULL_POINTER, "candidates");
    CASE(d.n_candidates = KM_RECORD_MAX_CANDIDATES + 1, KM_ERR_TOO_LARGE, "candidates");
    /* what the schema and the checker refuse is refused here, not written */
    CASE(d.owner = ((km_record_worker){NULL, "LIVE", 0}), KM_ERR_INVALID_ARGUMENT,
         "prediction.owner");
    CASE(d.owner = ((km_record_worker){NULL, NULL, 3}), KM_ERR_INVALID_ARGUMENT,
         "prediction.owner");
    CASE((d.load_scope = "cluster", d.load_oldest_age_ms = -1.5), KM_ERR_INVALID_ARGUMENT,
         "oldest_age_ms");
    CASE((d.load_scope = "cluster", d.load_stale_instances = "a,b,c,d,e,f,g,h,i"),
         KM_ERR_INVALID_ARGUMENT, "stale_instances");
    CASE((d.load_scope = "cluster", d.load_stale_instances = "a,,b"), KM_ERR_INVALID_ARGUMENT,
         "stale_instances");
    CASE((d.load_scope = "cluster", d.load_stale_instances = ",a"), KM_ERR_INVALID_ARGUMENT,
         "stale_instances");
    CASE((d.load_scope = "cluster", d.load_stale_instances = "in stance"),
         KM_ERR_INVALID_ARGUMENT, "stale_instances");
    CASE((d.load_scope = "cluster",
          d.load_stale_instances =
              "xy123456789012345678901234567890123456789012345678901234567890123" /* 65 */),
         KM_ERR_INVALID_ARGUMENT, "stale_instances");
#undef CASE
    /* the limits themselves are fine: 8 ids of 64 bytes, an owner-less prediction */
    owner_elsewhere_case(&d, c);
    d.owner = (km_record_worker){NULL, NULL, 0};
    d.load_scope = "cluster";
    d.load_oldest_age_ms = 0;
    char ids[8 * 65];
    size_t at = 0;
    for (int i = 0; i < 8; i++) {
        memset(ids + at, 'a' + i, 64);
        at += 64;
        ids[at++] = i < 7 ? ',' : '\0';
    }
    d.load_stale_instances = ids;
    cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s",
                 error);
    json_t *o = json_loads(line, 0, NULL);
    cr_assert(o, "%s", line);
    json_t *stale = json_object_get(json_object_get(json_object_get(o, "decision"), "load"),
                                    "stale_instances");
    cr_assert_eq(json_array_size(stale), 8);
    cr_assert_eq(strlen(json_string_value(json_array_get(stale, 7))), 64);
    json_decref(o);
    free(line);
}

/* The four load scopes are written as given, each but this_instance with the contributions'
 * fields; any other scope is refused by name and nothing is written. */
Test(records, load_scopes_with_engine_reported, .timeout = 10)
{
    km_decision_record d;
    km_record_candidate c[2];
    const char *scopes[] = {"this_instance", "cluster", "this_instance+engine_reported",
                            "cluster+engine_reported"};
    for (size_t i = 0; i < sizeof scopes / sizeof scopes[0]; i++) {
        owner_elsewhere_case(&d, c);
        d.load_scope = scopes[i];
        d.load_oldest_age_ms = 12.5;
        char *line;
        size_t len;
        char error[256];
        cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s",
                     error);
        json_t *o = json_loads(line, 0, NULL);
        json_t *load = json_object_get(json_object_get(o, "decision"), "load");
        cr_assert_str_eq(json_string_value(json_object_get(load, "scope")), scopes[i]);
        bool fields = i > 0;
        cr_assert_eq(json_object_get(load, "oldest_age_ms") != NULL, fields, "%s", scopes[i]);
        if (fields)
            cr_assert_float_eq(json_number_value(json_object_get(load, "oldest_age_ms")), 12.5,
                               1e-12);
        json_decref(o);
        free(line);
    }
    const char *bad[] = {"engine_reported", "cluster+", "this_instance+cluster", "Cluster"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        owner_elsewhere_case(&d, c);
        d.load_scope = bad[i];
        expect_decision_error(&d, KM_ERR_INVALID_ARGUMENT, "decision.load.scope");
    }
}

Test(records, bad_outcome_fields_are_rejected_by_name, .timeout = 10)
{
    km_decision_record d;
    km_record_candidate c[2];
    km_outcome_record o;
#define CASE(mutation, status, mention)                                                          \
    do {                                                                                          \
        owner_elsewhere_case(&d, c);                                                             \
        km_outcome_record_init(&o);                                                              \
        km_outcome_record_from_decision(&o, &d);                                                 \
        o.outcome = KM_RECORD_OUTCOME_INCOMPLETE;                                                       \
        o.dispatched = o.decided;                                                                \
        o.dispatched.monotonic_ns += 1000;                                                       \
        mutation;                                                                                 \
        expect_outcome_error(&o, status, mention);                                               \
    } while (0)
    CASE(o.outcome = 0, KM_ERR_INVALID_ARGUMENT, "outcome");
    CASE(o.outcome = 6, KM_ERR_INVALID_ARGUMENT, "outcome");
    CASE(o.done_seen = 3, KM_ERR_INVALID_ARGUMENT, "done_seen");
    CASE(o.http_status = 1000, KM_ERR_INVALID_ARGUMENT, "http_status");
    CASE(o.http_status = -1, KM_ERR_INVALID_ARGUMENT, "http_status");
    CASE(o.cached_tokens = -1, KM_ERR_INVALID_ARGUMENT, "cached_tokens");
    CASE(o.worker = NULL, KM_ERR_NULL_POINTER, "worker");
    CASE(o.error = "\xed\xa0\x80", KM_ERR_INVALID_ARGUMENT, "error"); /* a UTF-16 surrogate */
    CASE(o.source = 9, KM_ERR_INVALID_ARGUMENT, "source");
    CASE(o.block_size = -16, KM_ERR_INVALID_ARGUMENT, "block_size");
    CASE(o.predicted_depth_blocks = KM_RECORD_ABSENT, KM_ERR_INVALID_ARGUMENT, "depth_blocks");
    CASE(o.dispatched.monotonic_ns = o.decided.monotonic_ns - 1, KM_ERR_INVALID_ARGUMENT, "wait_ns");
    CASE(o.first_token.monotonic_ns = 1, KM_ERR_INVALID_ARGUMENT, "ttft_ns");
    CASE(o.router_ttft_ms = -2.5, KM_ERR_INVALID_ARGUMENT, "router_");
    CASE(o.router_e2e_ms = INFINITY, KM_ERR_INVALID_ARGUMENT, "router_");
    CASE(o.finished.wall_ns = -7, KM_ERR_INVALID_ARGUMENT, "finished_time");
    CASE(o.common.pool = NULL, KM_ERR_NULL_POINTER, "pool");
#undef CASE
    /* and the unmutated record is fine */
    owner_elsewhere_case(&d, c);
    km_outcome_record_init(&o);
    km_outcome_record_from_decision(&o, &d);
    o.outcome = KM_RECORD_OUTCOME_CANCELLED;
    char *line;
    size_t len;
    cr_assert_eq(km_outcome_record_format(&o, &line, &len, NULL, 0), KM_OK);
    free(line);
}

Test(records, names_and_instance_ids, .timeout = 10)
{
    cr_assert_str_eq(km_record_source_name(KM_RECORD_SOURCE_EVENTS), "events");
    cr_assert_str_eq(km_record_source_name(KM_RECORD_SOURCE_APPROX), "approx");
    cr_assert_str_eq(km_record_source_name((km_record_source)0), "unknown");
    cr_assert_str_eq(km_record_input_name(KM_RECORD_INPUT_HASHES), "hashes");
    cr_assert_str_eq(km_record_outcome_name(KM_RECORD_OUTCOME_INCOMPLETE), "incomplete");
    /* past either end of a list */
    cr_assert_str_eq(km_record_source_name((km_record_source)3), "unknown");
    cr_assert_str_eq(km_record_input_name((km_record_input)0), "unknown");
    cr_assert_str_eq(km_record_input_name((km_record_input)-1), "unknown");
    cr_assert_str_eq(km_record_outcome_name(KM_RECORD_OUTCOME_EXPIRED), "expired");
    cr_assert_str_eq(km_record_outcome_name((km_record_outcome)6), "unknown");
    cr_assert_str_eq(km_record_outcome_name((km_record_outcome)0x7fffffff), "unknown");
    char a[33], b[33];
    cr_assert_eq(km_record_instance_id(a), KM_OK);
    cr_assert_eq(km_record_instance_id(b), KM_OK);
    cr_assert_eq(strlen(a), 32);
    cr_assert_eq(strspn(a, "0123456789abcdef"), 32);
    cr_assert_str_neq(a, b);
    km_record_time t0 = km_record_time_now(), t1 = km_record_time_now();
    cr_assert(t0.wall_ns > INT64_C(1600000000) * 1000000000 && t1.monotonic_ns >= t0.monotonic_ns);
}

/* ---- schema ---------------------------------------------------------------------------------- */

static void require_checker(void)
{
    if (system("python3 -c 'import jsonschema' >/dev/null 2>&1") != 0)
        cr_skip_test("python3 with the jsonschema module is not available: schema not checked");
    cr_assert(access("tests/check_records.py", R_OK) == 0 && access("docs/records.schema.json", R_OK) == 0,
              "tests/check_records.py or docs/records.schema.json not found: run from the repository "
              "root");
}

/* Run the checker; returns its exit status, its output in out (first bytes). */
static int run_checker(const char *args, char *out, size_t out_size)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "python3 tests/check_records.py %s", args);
    return km_test_run_capture(cmd, out, out_size);
}

static void write_line(FILE *f, const char *line, size_t len)
{
    cr_assert_eq(fwrite(line, 1, len, f), len);
    cr_assert_eq(fputc('\n', f), '\n');
}

Test(records, every_line_validates_against_the_schema, .timeout = 120)
{
    require_checker();
    char dir[64], path[128], out[8192];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/records.jsonl", dir);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    static gen g, g2;
    km_rng_init(&g.rng, km_test_seed());
    km_rng_init(&g2.rng, km_test_seed() ^ 0x77);
    char *line;
    size_t len;
    char error[256];
    /* random decisions and outcomes (distinct decision ids so the links are unambiguous) */
    for (int i = 0; i < 300; i++) {
        km_decision_record d;
        gen_decision(&g, &d);
        d.common.instance = "inst";
        d.common.decision_id = 1000000 + i;
        cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s", error);
        write_line(f, line, len);
        free(line);
        /* its outcome, linked through from_decision (another generator: d's strings live in g) */
        km_outcome_record o, random;
        gen_outcome(&g2, &random);
        o = random;
        km_outcome_record_from_decision(&o, &d);
        o.common.record_id = 5000000 + i;
        o.decided = d.common.time;
        o.dispatched = o.first_token = o.finished = (km_record_time){KM_RECORD_ABSENT, KM_RECORD_ABSENT};
        if (km_rng_percent(&g.rng, 70)) {
            o.dispatched = d.common.time;
            o.dispatched.monotonic_ns += km_rng_below(&g.rng, 1000000);
            o.first_token = o.dispatched;
            o.first_token.monotonic_ns += km_rng_below(&g.rng, 1000000);
        }
        cr_assert_eq(km_outcome_record_format(&o, &line, &len, error, sizeof error), KM_OK, "%s", error);
        write_line(f, line, len);
        free(line);
    }
    /* the named cases */
    km_decision_record d;
    km_record_candidate c[2];
    owner_elsewhere_case(&d, c);
    d.common.instance = "inst";
    cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK, "%s", error);
    write_line(f, line, len);
    free(line);
    km_outcome_record o;
    km_outcome_record_init(&o);
    km_outcome_record_from_decision(&o, &d);
    o.outcome = KM_RECORD_OUTCOME_EXPIRED;
    cr_assert_eq(km_outcome_record_format(&o, &line, &len, error, sizeof error), KM_OK, "%s", error);
    write_line(f, line, len);
    free(line);
    cr_assert_eq(fclose(f), 0);

    char args[256];
    snprintf(args, sizeof args, "--require-links %s", path);
    int rc = run_checker(args, out, sizeof out);
    KM_CHECK(rc == 0, "check_records failed (%d):\n%s", rc, out);
    cr_assert(strstr(out, "602 line(s), 301 decision(s), 301 outcome(s)") != NULL, "%s", out);

    /* the checker is not vacuous: each corrupted line below must fail, naming its line */
    static const struct {
        const char *from, *to;
    } corruptions[] = {
        {"\"units\":\"blocks\"", "\"units\":\"tokens\""},
        {"\"scope\":\"this_instance\"", "\"scope\":\"everyone\""},
        {"\"depth_tokens\":192", "\"depth_tokens\":193"},
        {"\"owner_is_chosen\":false", "\"owner_is_chosen\":true"},
        {"\"source\":\"events\"", "\"source\":\"guess\""},
        {"\"request_id\":\"req-1\"", "\"request_id\":7"},
        {"\"pool\":\"default\",", ""},
        {"\"type\":\"decision\"", "\"type\":\"decision\",\"extra\":1"},
        {".123456Z\"", "Z\""},
        /* not JSON (RFC 8259), though Python's json module reads them */
        {"\"value\":1.0", "\"value\":NaN"},
        {"\"value\":1.0", "\"value\":-Infinity"},
        /* a key twice: which one counts is up to the reader (the analyzer refuses the line) */
        {"\"block_count\":40", "\"block_count\":40,\"block_count\":41"},
        /* integers are below 2^63 (docs/RECORDS.md) */
        {"\"block_count\":40", "\"block_count\":9223372036854775808"},
    };
    owner_elsewhere_case(&d, c);
    cr_assert_eq(km_decision_record_format(&d, &line, &len, error, sizeof error), KM_OK);
    for (size_t i = 0; i < sizeof corruptions / sizeof corruptions[0]; i++) {
        const char *at = strstr(line, corruptions[i].from);
        cr_assert(at, "corruption %zu does not apply to %s", i, line);
        f = fopen(path, "w");
        fprintf(f, "%.*s%s%s\n", (int)(at - line), line, corruptions[i].to, at + strlen(corruptions[i].from));
        fclose(f);
        rc = run_checker(path, out, sizeof out);
        KM_CHECK(rc == 1, "corruption %zu (%s) passed the checker:\n%s", i, corruptions[i].to, out);
        cr_assert(strstr(out, ":1: ") != NULL, "no line number in:\n%s", out);
    }
    /* an outcome whose copied prediction disagrees with its decision, and a cut last line */
    f = fopen(path, "w");
    write_line(f, line, len);
    km_outcome_record_init(&o);
    km_outcome_record_from_decision(&o, &d);
    o.outcome = KM_RECORD_OUTCOME_COMPLETE;
    o.owner_worker = "B";
    char *line2;
    size_t len2;
    cr_assert_eq(km_outcome_record_format(&o, &line2, &len2, error, sizeof error), KM_OK);
    write_line(f, line2, len2);
    fwrite(line2, 1, len2 / 2, f);
    fclose(f);
    rc = run_checker(path, out, sizeof out);
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "predicted.owner_worker") != NULL, "%s", out);
    cr_assert(strstr(out, ":3: ") != NULL, "%s", out);
    free(line2);
    free(line);
    remove_dir(dir);
}

/* ---- the writer ------------------------------------------------------------------------------ */

typedef struct log_capture {
    pthread_mutex_t lock;
    int lines;
    char last[512];
} log_capture;

static void capture_log(void *user, const char *line)
{
    log_capture *c = user;
    pthread_mutex_lock(&c->lock);
    c->lines++;
    snprintf(c->last, sizeof c->last, "%s", line);
    pthread_mutex_unlock(&c->lock);
}

static void writer_config(km_record_writer_config *cfg, const char *path, log_capture *log)
{
    km_record_writer_config_init(cfg);
    cfg->path = path;
    cfg->flush_interval_ms = 5;
    if (log) {
        pthread_mutex_init(&log->lock, NULL);
        log->lines = 0;
        log->last[0] = '\0';
        cfg->log = capture_log;
        cfg->log_user = log;
    }
}

Test(records, writer_rejects_bad_arguments, .timeout = 10)
{
    km_record_writer *w = (km_record_writer *)1;
    km_record_writer_config cfg;
    cr_assert_eq(km_record_writer_create(NULL, &w), KM_ERR_NULL_POINTER);
    cr_assert_null(w);
    km_record_writer_config_init(&cfg);
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_ERR_NULL_POINTER); /* no path */
    cfg.path = "";
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_ERR_INVALID_ARGUMENT);
    cfg.path = "/tmp/x";
    cfg.queue_capacity = 0;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_ERR_INVALID_ARGUMENT);
    km_record_writer_config_init(&cfg);
    cfg.path = "/tmp/x";
    cfg.flush_interval_ms = 0;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_ERR_INVALID_ARGUMENT);
    km_record_writer_destroy(NULL);

    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    writer_config(&cfg, path, NULL);
    cfg.max_line_bytes = 100;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char big[101];
    memset(big, 'x', sizeof big);
    cr_assert_eq(km_record_writer_submit(w, NULL, 3), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_record_writer_submit(w, "x", 0), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_record_writer_submit(w, "a\nb", 3), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_record_writer_submit(w, big, 101), KM_ERR_TOO_LARGE);
    cr_assert_eq(km_record_writer_submit(w, big, 100), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.submitted, 1);
    cr_assert_eq(s.written, 1);
    cr_assert_eq(s.dropped, 0);
    cr_assert_eq(s.bytes, 101);
    km_record_writer_destroy(w);
    size_t n;
    char *data = read_file(path, &n);
    cr_assert_eq(n, 101);
    cr_assert_eq(data[100], '\n');
    free(data);
    remove_dir(dir);
}

typedef struct submitter {
    km_record_writer *writer;
    int thread;
    int lines;
    int overloaded; /* retries needed (should be 0 with a queue this large) */
} submitter;

static void *submit_lines(void *arg)
{
    submitter *s = arg;
    km_rng rng;
    km_rng_init(&rng, km_test_seed() + (uint64_t)s->thread);
    char line[700];
    for (int i = 0; i < s->lines; i++) {
        int pad = (int)km_rng_below(&rng, 600);
        int n = snprintf(line, sizeof line, "{\"t\":%d,\"i\":%d,\"pad\":\"%*s\"}", s->thread, i, pad, "");
        int rc;
        while ((rc = km_record_writer_submit(s->writer, line, (size_t)n)) == KM_ERR_OVERLOADED) {
            s->overloaded++;
            usleep(100);
        }
        if (rc != KM_OK)
            return (void *)1;
    }
    return NULL;
}

Test(records, writer_concurrent_submitters_lines_whole_and_in_order, .timeout = 60)
{
    enum { THREADS = 8, LINES = 4000 };
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    log_capture log;
    writer_config(&cfg, path, &log);
    cfg.max_file_bytes = 0;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    pthread_t threads[THREADS];
    submitter subs[THREADS];
    for (int t = 0; t < THREADS; t++) {
        subs[t] = (submitter){w, t, LINES, 0};
        cr_assert_eq(pthread_create(&threads[t], NULL, submit_lines, &subs[t]), 0);
    }
    uint64_t retries = 0;
    for (int t = 0; t < THREADS; t++) {
        void *ret;
        pthread_join(threads[t], &ret);
        cr_assert_null(ret, "thread %d: a submit failed", t);
        retries += (uint64_t)subs[t].overloaded;
    }
    cr_assert_eq(km_record_writer_flush(w, 30000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.submitted, THREADS * LINES);
    cr_assert_eq(s.written, THREADS * LINES);
    cr_assert_eq(s.failed, 0);
    cr_assert_eq(s.pending, 0);
    cr_assert_eq(s.dropped, retries);
    cr_assert_eq(s.write_errors, 0);

    /* read it while the writer still runs: flush promised it is all there */
    size_t n;
    char *data = read_file(path, &n);
    cr_assert(data);
    cr_assert_eq(n, s.bytes);
    int next[THREADS] = {0};
    size_t count = 0;
    char *save = NULL;
    cr_assert(n > 0 && data[n - 1] == '\n');
    for (char *l = strtok_r(data, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_error_t err;
        json_t *o = json_loads(l, 0, &err);
        KM_CHECK(o != NULL, "line %zu is not whole JSON (%s): %.80s", count, err.text, l);
        int t = (int)json_integer_value(json_object_get(o, "t"));
        int i = (int)json_integer_value(json_object_get(o, "i"));
        KM_CHECK(t >= 0 && t < THREADS && i == next[t], "thread %d: line %d after %d", t, i, next[t] - 1);
        next[t]++;
        count++;
        json_decref(o);
    }
    cr_assert_eq(count, (size_t)THREADS * LINES);
    free(data);
    km_record_writer_destroy(w);
    cr_assert_eq(log.lines, 0, "unexpected log: %s", log.last);
    remove_dir(dir);
}

/* A lone line stays in the writer's buffer while its flush_interval_ms (60 s here) has not
 * passed: 300 ms after the submit it is not in the file and not counted as written. A flush puts
 * it there; a second lone line reaches the file on destroy. A writer that writes every line at
 * once fails the first check (on a machine too loaded to run the writer thread within 300 ms it
 * would not be caught; a correct writer passes however slow the machine). */
Test(records, writer_holds_a_lone_line_until_the_interval_or_a_flush, .timeout = 30)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.flush_interval_ms = 60000;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    usleep(300 * 1000);
    char *data = read_file(path, NULL);
    cr_assert(!data || !*data, "the line was written before its interval or a flush: %s", data);
    free(data);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 0);
    cr_assert_eq(s.pending, 1);

    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    data = read_file(path, NULL);
    cr_assert(data && strcmp(data, "{\"a\":1}\n") == 0, "after flush: %s", data);
    free(data);
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 1);
    cr_assert_eq(s.pending, 0);

    cr_assert_eq(km_record_writer_submit(w, "{\"b\":2}", 7), KM_OK);
    usleep(300 * 1000);
    data = read_file(path, NULL);
    cr_assert(data && strcmp(data, "{\"a\":1}\n") == 0, "the second line was written early: %s",
              data);
    free(data);
    km_record_writer_destroy(w);
    data = read_file(path, NULL);
    cr_assert(data && strcmp(data, "{\"a\":1}\n{\"b\":2}\n") == 0, "after destroy: %s", data);
    free(data);
    remove_dir(dir);
}

/* With a short flush_interval_ms a lone line reaches the file with no flush and no further
 * line: the interval alone writes it. Polled until it is there; the test's timeout bounds it. */
Test(records, writer_writes_a_lone_line_once_its_interval_passed, .timeout = 30)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.flush_interval_ms = 20;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    char *data = NULL;
    for (;;) {
        data = read_file(path, NULL);
        if (data && strcmp(data, "{\"a\":1}\n") == 0)
            break;
        cr_assert(!data || strncmp(data, "{\"a\":1}\n", strlen(data)) == 0, "the file: %s",
                  data);
        free(data);
        usleep(2000);
    }
    free(data);
    /* the flush finds nothing left to write: the line is in the file once */
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 1);
    data = read_file(path, NULL);
    cr_assert(data && strcmp(data, "{\"a\":1}\n") == 0, "after flush: %s", data);
    free(data);
    km_record_writer_destroy(w);
    remove_dir(dir);
}

typedef struct fifo_drain {
    int fd;
    char *data;
    size_t len, cap;
} fifo_drain;

static void *drain_fifo(void *arg)
{
    fifo_drain *d = arg;
    for (;;) {
        if (d->len + 65536 > d->cap) {
            d->cap = d->cap ? d->cap * 2 : 1 << 20;
            d->data = realloc(d->data, d->cap);
        }
        ssize_t n = read(d->fd, d->data + d->len, d->cap - d->len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        d->len += (size_t)n;
    }
    return NULL;
}

/* A FIFO with a reader that does not read: the writer thread blocks in write() once the pipe is
 * full; submit must keep returning, dropping and counting, and flush must time out. Nothing reads
 * the FIFO until every submit has returned, so a submit that waited for room would never return
 * (the test's timeout): no latency is measured. */
Test(records, full_queue_drops_instead_of_blocking, .timeout = 60)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/fifo", dir);
    cr_assert_eq(mkfifo(path, 0600), 0, "mkfifo: %s", strerror(errno));
    int reader = open(path, O_RDONLY | O_NONBLOCK);
    cr_assert(reader >= 0);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.queue_capacity = 4;
    cfg.flush_interval_ms = 1;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);

    static char line[8192];
    int accepted = 0, overloaded = 0;
    int accepted_ids[4096];
    for (int i = 0; i < 3000; i++) {
        int n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"", i);
        memset(line + n, 'p', 8000);
        n += 8000;
        n += snprintf(line + n, sizeof line - (size_t)n, "\"}");
        int rc = km_record_writer_submit(w, line, (size_t)n);
        if (rc == KM_OK)
            accepted_ids[accepted++] = i;
        else {
            cr_assert_eq(rc, KM_ERR_OVERLOADED, "submit: %s", km_error_name(rc));
            overloaded++;
        }
        if (i % 100 == 0)
            usleep(1000); /* let the writer reach its stall */
    }
    /* pipe (64 KiB) + the writer's buffer + a 4-line queue hold a few hundred 8 KB lines at most */
    cr_assert_gt(overloaded, 2000, "only %d drops: the writer did not stall?", overloaded);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.dropped, (uint64_t)overloaded);
    cr_assert_eq(s.submitted, (uint64_t)accepted);
    cr_assert_eq(km_record_writer_flush(w, 50), KM_ERR_TIMEOUT);

    /* unstall: read everything; destroy drains the rest and closes (EOF for the reader) */
    int flags = fcntl(reader, F_GETFL);
    fcntl(reader, F_SETFL, flags & ~O_NONBLOCK);
    fifo_drain drain = {reader, NULL, 0, 0};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, drain_fifo, &drain), 0);
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, (uint64_t)accepted);
    km_record_writer_destroy(w);
    pthread_join(t, NULL);
    close(reader);

    /* exactly the accepted lines, whole, in order */
    int count = 0;
    char *save = NULL;
    cr_assert(drain.len > 0 && drain.data[drain.len - 1] == '\n');
    drain.data[drain.len - 1] = '\0';
    for (char *l = strtok_r(drain.data, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(l, 0, NULL);
        cr_assert(o, "line %d is not whole", count);
        cr_assert_lt(count, accepted);
        cr_assert_eq(json_integer_value(json_object_get(o, "i")), accepted_ids[count]);
        cr_assert_eq(strlen(json_string_value(json_object_get(o, "pad"))), 8000);
        json_decref(o);
        count++;
    }
    cr_assert_eq(count, accepted);
    free(drain.data);
    remove_dir(dir);
}

/* A FIFO whose reader is away (open would block: ENXIO) or stalls (its pipe full: write would
 * block) holds the writer as a blocking call would (a flush times out, the lines wait) but never
 * the destroy: once stopping, the writer waits about a second more for the reader, then what is
 * left fails, logged. */
Test(records, a_fifo_reader_away_or_stalled_never_holds_destroy, .timeout = 30)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/fifo", dir);
    cr_assert_eq(mkfifo(path, 0600), 0, "mkfifo: %s", strerror(errno));
    log_capture log;
    km_record_writer_config cfg;
    writer_config(&cfg, path, &log);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 100), KM_ERR_TIMEOUT, "no reader, yet the lines went");
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.pending, 5, "lines failed while the reader might still come");
    double t0 = km_test_now();
    km_record_writer_destroy(w);
    cr_assert_lt(km_test_now() - t0, 5.0, "destroy waited for a reader");
    cr_assert(strstr(log.last, "open") && strstr(log.last, strerror(ENXIO)), "%s", log.last);
    cr_assert_eq(log.lines, 2, "the wait for a reader was not said (then the failure)");

    /* A reader that never reads: 40 lines of 8 KB are five times the pipe. */
    int reader = open(path, O_RDONLY | O_NONBLOCK);
    cr_assert(reader >= 0, "%s", strerror(errno));
    writer_config(&cfg, path, &log);
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    static char line[8000];
    memset(line, 'p', sizeof line);
    line[0] = '"';
    line[sizeof line - 1] = '"';
    for (int i = 0; i < 40; i++)
        cr_assert_eq(km_record_writer_submit(w, line, sizeof line), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 200), KM_ERR_TIMEOUT, "the stalled pipe took it all");
    t0 = km_test_now();
    km_record_writer_destroy(w);
    cr_assert_lt(km_test_now() - t0, 5.0, "destroy waited for the reader to read");
    cr_assert(strstr(log.last, "write") && strstr(log.last, strerror(EAGAIN)), "%s", log.last);
    close(reader);

    /* A socket's path opens with ENXIO too, but no reader will come: it fails at once. */
    unlink(path);
    int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    cr_assert_lt(strlen(path), sizeof addr.sun_path);
    memcpy(addr.sun_path, path, strlen(path) + 1);
    cr_assert_eq(bind(sock, (struct sockaddr *)&addr, sizeof addr), 0, "%s", strerror(errno));
    writer_config(&cfg, path, &log);
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 5000), KM_ERR_IO, "a socket's path was waited on");
    km_record_writer_destroy(w);
    close(sock);
    remove_dir(dir);
}

/* Lines "{"i":N,"pad":"..."}" of varying length; returns the numbers found in a file in order,
 * asserting each file ends with a newline and stays within max (lines shorter than max). */
static int read_numbers(const char *path, int *out, int cap, uint64_t max, bool *exists)
{
    size_t n;
    char *data = read_file(path, &n);
    *exists = data != NULL;
    if (!data)
        return 0;
    if (max)
        cr_assert_leq(n, max, "%s has %zu bytes, more than %" PRIu64, path, n, max);
    cr_assert(n == 0 || data[n - 1] == '\n', "%s does not end with a newline", path);
    int count = 0;
    char *save = NULL;
    for (char *l = strtok_r(data, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(l, 0, NULL);
        cr_assert(o, "a split line in %s: %.60s", path, l);
        cr_assert_lt(count, cap);
        out[count++] = (int)json_integer_value(json_object_get(o, "i"));
        json_decref(o);
    }
    free(data);
    return count;
}

Test(records, rotation_by_size_keeps_n_files_and_never_splits_a_line, .timeout = 60)
{
    char dir[64], path[128], name[160];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.max_file_bytes = 4096;
    cfg.keep_files = 3;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char line[6000];
    const int total = 600;
    for (int i = 0; i < total; i++) {
        int pad = (int)km_rng_below(&rng, 300);
        int n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"%*s\"}", i, pad, "");
        cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
        if (i % 50 == 0)
            cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK); /* vary the batches */
    }
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, (uint64_t)total);
    cr_assert_geq(s.rotations, 3);
    /* roughly bytes / 4096 rotations: a file is only cut when the next line does not fit */
    cr_assert_leq(s.rotations, s.bytes / (4096 - 330) + 1, "%" PRIu64 " rotations for %" PRIu64 " bytes",
                  s.rotations, s.bytes);

    /* path.3 (oldest) .. path.1, path: consecutive numbers ending at total - 1 */
    static int numbers[4][1000];
    int counts[4];
    bool exists;
    for (int k = 3; k >= 0; k--) {
        if (k)
            snprintf(name, sizeof name, "%s.%d", path, k);
        else
            snprintf(name, sizeof name, "%s", path);
        counts[k] = read_numbers(name, numbers[k], 1000, 4096, &exists);
        cr_assert(exists, "%s is missing", name);
        cr_assert_gt(counts[k], 0, "%s is empty", name);
    }
    snprintf(name, sizeof name, "%s.4", path);
    cr_assert_neq(access(name, F_OK), 0, "%s kept beyond keep_files", name);
    int expect = numbers[3][0];
    for (int k = 3; k >= 0; k--)
        for (int j = 0; j < counts[k]; j++)
            cr_assert_eq(numbers[k][j], expect++, "gap or reorder across rotated files");
    cr_assert_eq(expect, total);
    /* every record not in a kept file was deleted by rotation, and counted */
    cr_assert_eq(s.deleted_records, (uint64_t)numbers[3][0], "deleted %" PRIu64 ", missing %d",
                 s.deleted_records, numbers[3][0]);
    cr_assert_eq(s.deleted_files, s.rotations - 3);

    /* a line longer than max_file_bytes goes alone into a file */
    int n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"%*s\"}", total, 5000, "");
    cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
    n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"\"}", total + 1);
    cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
    km_record_writer_destroy(w);
    snprintf(name, sizeof name, "%s.1", path);
    counts[0] = read_numbers(name, numbers[0], 1000, 0, &exists);
    cr_assert_eq(counts[0], 1);
    cr_assert_eq(numbers[0][0], total);
    counts[0] = read_numbers(path, numbers[0], 1000, 4096, &exists);
    cr_assert_eq(counts[0], 1);
    cr_assert_eq(numbers[0][0], total + 1);
    remove_dir(dir);
}

/* Lines "{"i":N}" in `name` (a missing file holds none). */
static int count_lines_in(const char *name)
{
    FILE *f = fopen(name, "r");
    if (!f)
        return 0;
    int n = 0;
    for (int ch; (ch = fgetc(f)) != EOF;)
        n += ch == '\n';
    fclose(f);
    return n;
}

/* A file truncated behind the writer's back (logrotate's copytruncate, no SIGHUP) is rotated by
 * its size now, not by the size the writer last saw: a short line into the emptied file rotates
 * nothing, so the rotated file and its records stay. */
Test(records, a_file_truncated_behind_the_writer_is_not_rotated_early, .timeout = 30)
{
    char dir[64], path[128], name[160];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    snprintf(name, sizeof name, "%s.1", path);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.max_file_bytes = 1000;
    cfg.keep_files = 1;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char line[256];
    /* 90-byte lines (89 and a newline): 11 fill the file, the 12th rotates it: path.1 holds
     * 11, path 1 */
    for (int i = 0; i < 12; i++) {
        int n = snprintf(line, sizeof line, "{\"i\":%2d,\"pad\":\"%*s\"}", i, 72, "");
        cr_assert_eq(n, 89);
        cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
        cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    }
    for (int i = 12; i < 21; i++) { /* path: 10 lines, 900 bytes */
        int n = snprintf(line, sizeof line, "{\"i\":%2d,\"pad\":\"%*s\"}", i, 72, "");
        cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
    }
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.rotations, 1);
    cr_assert_eq(count_lines_in(name), 11);
    cr_assert_eq(count_lines_in(path), 10);
    /* copytruncate: the lines are copied elsewhere and path is cut to 0 */
    cr_assert_eq(truncate(path, 0), 0, "%s", strerror(errno));
    int n = snprintf(line, sizeof line, "{\"i\":21,\"pad\":\"%*s\"}", 150, "");
    cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.rotations, 1, "a 0-byte file was rotated");
    cr_assert_eq(s.deleted_records, 0);
    cr_assert_eq(count_lines_in(name), 11, "the rotated records were deleted");
    cr_assert_eq(count_lines_in(path), 1);
    km_record_writer_destroy(w);
    remove_dir(dir);
}

/* Retention by bytes and by age: the files past either limit are deleted at a rotation, their
 * records counted exactly (files an earlier run left included), one log line per rotation that
 * deleted something. */
Test(records, retention_by_bytes_and_age_counts_every_deleted_record, .timeout = 60)
{
    char dir[64], path[128], name[160];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    /* An earlier run's rotated file, old: 7 records (the last one cut short by a crash). */
    snprintf(name, sizeof name, "%s.1", path);
    FILE *f = fopen(name, "w");
    cr_assert(f);
    for (int i = 0; i < 6; i++)
        fprintf(f, "{\"old\":%d}\n", i);
    fputs("{\"old\":6", f);
    fclose(f);
    struct timeval past[2] = {{time(NULL) - 7200, 0}, {time(NULL) - 7200, 0}};
    cr_assert_eq(utimes(name, past), 0);

    log_capture log;
    km_record_writer_config cfg;
    writer_config(&cfg, path, &log);
    cfg.max_file_bytes = 2000;
    cfg.keep_files = 6;
    cfg.max_kept_bytes = 5000; /* about two and a half rotated files */
    cfg.max_age_s = 3600;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char line[256];
    const int total = 400;
    for (int i = 0; i < total; i++) {
        int n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"%40s\"}", i, "");
        cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
        if (i % 20 == 0)
            cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    }
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    km_record_writer_destroy(w);
    int kept = count_lines_in(path), kept_bytes = 0;
    for (int k = 1; k <= 7; k++) {
        snprintf(name, sizeof name, "%s.%d", path, k);
        struct stat st;
        if (stat(name, &st) == 0) {
            cr_assert_leq(k, 6, "%s kept beyond keep_files", name);
            kept += count_lines_in(name);
            kept_bytes += (int)st.st_size;
        }
    }
    cr_assert_leq(kept_bytes, 5000, "rotated files hold %d bytes", kept_bytes);
    cr_assert_gt(s.rotations, 5);
    /* all 400 records and the earlier run's 7 are either kept or counted as deleted */
    cr_assert_eq((uint64_t)kept + s.deleted_records, (uint64_t)total + 7,
                 "kept %d + deleted %" PRIu64 " != %d", kept, s.deleted_records, total + 7);
    cr_assert_gt(s.deleted_files, 0);
    pthread_mutex_lock(&log.lock);
    cr_assert_eq(log.lines, (int)s.deleted_files, "%d log lines for %" PRIu64 " deleted files "
                 "(one file per rotation here)", log.lines, s.deleted_files);
    cr_assert(strstr(log.last, "deleted 1 file holding") && strstr(log.last, "max_kept_bytes"),
              "%s", log.last);
    pthread_mutex_unlock(&log.lock);
    remove_dir(dir);
}

Test(records, rotation_with_keep_zero_keeps_only_the_current_file, .timeout = 30)
{
    char dir[64], path[128], name[160];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.max_file_bytes = 1000;
    cfg.keep_files = 0;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char line[200];
    for (int i = 0; i < 100; i++) {
        int n = snprintf(line, sizeof line, "{\"i\":%d,\"pad\":\"%*s\"}", i, 80, "");
        cr_assert_eq(km_record_writer_submit(w, line, (size_t)n), KM_OK);
    }
    km_record_writer_destroy(w);
    int numbers[100];
    bool exists;
    int count = read_numbers(path, numbers, 100, 1000, &exists);
    cr_assert(count > 0 && numbers[count - 1] == 99);
    for (int j = 1; j < count; j++)
        cr_assert_eq(numbers[j], numbers[j - 1] + 1);
    snprintf(name, sizeof name, "%s.1", path);
    cr_assert_neq(access(name, F_OK), 0);
    remove_dir(dir);
}

/* logrotate's move then SIGHUP (km_record_writer_reopen): the lines submitted before the reopen
 * go to the moved file, those buffered for the flush interval included, and the lines after it
 * to a new file at the path, however soon they follow. */
Test(records, a_reopen_after_a_move_keeps_earlier_lines_in_the_moved_file, .timeout = 30)
{
    char dir[64], path[160], first[170], second[170];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    snprintf(first, sizeof first, "%s.1", path);
    snprintf(second, sizeof second, "%s.2", path);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.flush_interval_ms = 60000; /* what the writer took stays in its buffer */
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    /* lines the writer has taken into its buffer */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"before\":1}", 12), KM_OK);
    usleep(100 * 1000);
    cr_assert_eq(rename(path, first), 0);
    cr_assert_eq(km_record_writer_reopen(w), KM_OK);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"after\":1}", 11), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    /* lines still queued at the reopen, and lines right after it */
    cr_assert_eq(km_record_writer_submit(w, "{\"queued\":1}", 12), KM_OK);
    cr_assert_eq(rename(path, second), 0);
    cr_assert_eq(km_record_writer_reopen(w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"next\":1}", 10), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 7);
    km_record_writer_destroy(w);
    char *data = read_file(first, NULL);
    cr_assert_str_eq(data, "{\"before\":1}\n{\"before\":1}\n{\"before\":1}\n",
                     "the moved file keeps the lines submitted before the reopen");
    free(data);
    data = read_file(second, NULL);
    cr_assert_str_eq(data, "{\"after\":1}\n{\"after\":1}\n{\"queued\":1}\n");
    free(data);
    data = read_file(path, NULL);
    cr_assert_str_eq(data, "{\"next\":1}\n", "the path gets the lines after the reopen");
    free(data);
    remove_dir(dir);
}

Test(records, unwritable_path_counts_errors_and_recovers, .timeout = 30)
{
    char dir[64], path[160], sub[128];
    make_temp_dir(dir);
    snprintf(sub, sizeof sub, "%s/not-yet", dir);
    snprintf(path, sizeof path, "%s/r.jsonl", sub);
    km_record_writer_config cfg;
    log_capture log;
    writer_config(&cfg, path, &log);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    for (int i = 0; i < 10; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"lost\":1}", 10), KM_OK, "submit must not fail on I/O");
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_ERR_IO);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.failed, 10);
    cr_assert_eq(s.written, 0);
    cr_assert_eq(s.pending, 0);
    cr_assert_gt(s.write_errors, 0);
    cr_assert_eq(s.last_error_status, KM_ERR_IO);
    char error[512];
    cr_assert_gt(km_record_writer_last_error(w, error, sizeof error), 0);
    cr_assert(strstr(error, path) && strstr(error, "KM_ERR_IO") && strstr(error, "No such file"), "%s", error);
    cr_assert_eq(log.lines, 1, "one log line for the failing state, got %d (%s)", log.lines, log.last);

    /* the directory appears: later records are written (the writer reopens) */
    cr_assert_eq(mkdir(sub, 0700), 0);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"kept\":1}", 10), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 5);
    cr_assert_eq(s.failed, 10);
    cr_assert_eq(log.lines, 2, "a recovery line is logged");
    km_record_writer_destroy(w);
    char *data = read_file(path, NULL);
    cr_assert_str_eq(data, "{\"kept\":1}\n{\"kept\":1}\n{\"kept\":1}\n{\"kept\":1}\n{\"kept\":1}\n");
    free(data);
    remove_dir(dir);
}

Test(records, full_disk_counts_errors_and_keeps_running, .timeout = 30)
{
    if (access("/dev/full", W_OK) != 0)
        cr_skip_test("/dev/full is not available");
    km_record_writer_config cfg;
    log_capture log;
    writer_config(&cfg, "/dev/full", &log);
    cfg.max_file_bytes = 0;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 20; i++)
            cr_assert_eq(km_record_writer_submit(w, "{\"x\":1}", 7), KM_OK);
        cr_assert_eq(km_record_writer_flush(w, 10000), KM_ERR_IO);
    }
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.failed, 60);
    cr_assert_eq(s.written, 0);
    cr_assert_geq(s.write_errors, 3);
    char error[512];
    km_record_writer_last_error(w, error, sizeof error);
    cr_assert(strstr(error, "No space"), "%s", error);
    cr_assert_eq(log.lines, 1, "log only on the transition, got %d", log.lines);
    km_record_writer_destroy(w);
}

Test(records, a_cut_last_line_is_terminated_before_appending, .timeout = 10)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"whole\":1}\n{\"cut", f);
    fclose(f);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"b\":2}", 7), KM_OK);
    km_record_writer_destroy(w);
    char *data = read_file(path, NULL);
    cr_assert_str_eq(data, "{\"whole\":1}\n{\"cut\n{\"a\":1}\n{\"b\":2}\n");
    free(data);
    remove_dir(dir);
}

Test(records, records_through_the_writer_validate, .timeout = 60)
{
    require_checker();
    char dir[64], path[128], out[8192], args[4096];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.max_file_bytes = 64 * 1024;
    cfg.keep_files = 100;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    gen g;
    km_rng_init(&g.rng, km_test_seed());
    char *line;
    size_t len;
    for (int i = 0; i < 400; i++) {
        km_decision_record d;
        gen_decision(&g, &d);
        d.common.instance = "writer-test";
        d.common.decision_id = i; /* unique, so the checker's duplicate rule holds */
        cr_assert_eq(km_decision_record_format(&d, &line, &len, NULL, 0), KM_OK);
        cr_assert_eq(km_record_writer_submit(w, line, len), KM_OK);
        free(line);
        km_outcome_record o;
        gen_outcome(&g, &o);
        o.common.instance = "writer-test";
        o.common.decision_id = 1000000 + i; /* decision not in the files: a note, not a failure */
        cr_assert_eq(km_outcome_record_format(&o, &line, &len, NULL, 0), KM_OK);
        cr_assert_eq(km_record_writer_submit(w, line, len), KM_OK);
        free(line);
    }
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 800);
    km_record_writer_destroy(w);
    int n = snprintf(args, sizeof args, "%s", path);
    for (uint64_t k = 1; k <= s.rotations + 1 && k <= 100; k++) {
        char name[160];
        snprintf(name, sizeof name, "%s.%" PRIu64, path, k);
        if (access(name, F_OK) == 0)
            n += snprintf(args + n, sizeof args - (size_t)n, " %s", name);
    }
    int rc = run_checker(args, out, sizeof out);
    KM_CHECK(rc == 0, "check_records failed (%d):\n%s", rc, out);
    cr_assert(strstr(out, "800 line(s)") != NULL, "%s", out);
    remove_dir(dir);
}

/* Records queued as structs are deep-copied at submit and formatted by the writer thread: the
 * file holds exactly what the format functions produce, although the caller's strings were
 * overwritten right after each submit; a record that does not format is counted, not written. */
Test(records, deferred_records_are_copied_and_formatted_by_the_writer, .timeout = 60)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    static gen g;
    km_rng_init(&g.rng, km_test_seed());
    enum { N = 300 };
    static char *expected[2 * N];
    size_t n_expected = 0;
    char error[256];
    for (int i = 0; i < N; i++) {
        km_decision_record d;
        gen_decision(&g, &d);
        size_t len;
        cr_assert_eq(km_decision_record_format(&d, &expected[n_expected], &len, error, sizeof error), KM_OK);
        n_expected++;
        cr_assert_eq(km_record_writer_submit_decision(w, &d), KM_OK);
        memset(g.strings, 'Z', sizeof g.strings); /* the queued copy must not see this */
        for (size_t k = 0; k < 12; k++)
            g.candidates[k].worker = "overwritten";

        km_outcome_record o;
        gen_outcome(&g, &o);
        /* The worker names too live in the caller's memory (the service's attempt, reused once
         * its outcome is submitted): dispatched_worker included, each is copied, so the writer
         * never prints whatever the attempt holds by then. */
        o.worker = in_strings(&g, o.worker);
        o.dispatched_worker = in_strings(&g, o.dispatched_worker);
        o.owner_worker = in_strings(&g, o.owner_worker);
        cr_assert_eq(km_outcome_record_format(&o, &expected[n_expected], &len, error, sizeof error), KM_OK);
        n_expected++;
        cr_assert_eq(km_record_writer_submit_outcome(w, &o), KM_OK);
        memset(g.strings, 'Y', sizeof g.strings);
    }
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);

    /* an invalid record: accepted (checked later, off the caller's thread), counted, not written */
    km_decision_record bad;
    km_record_candidate c[2];
    owner_elsewhere_case(&bad, c);
    bad.chosen.state = "live"; /* index states are upper case */
    cr_assert_eq(km_record_writer_submit_decision(w, &bad), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK, "reported once");
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.invalid, 1);
    cr_assert_eq(s.written, 2 * N);
    cr_assert_eq(s.submitted, 2 * N + 1);
    cr_assert_eq(s.pending, 0);
    cr_assert_eq(s.last_error_status, KM_ERR_INVALID_ARGUMENT);
    km_record_writer_last_error(w, error, sizeof error);
    cr_assert(strstr(error, "state") && strstr(error, "decision.chosen"), "%s", error);

    /* what can be checked at once is */
    owner_elsewhere_case(&bad, c);
    bad.n_candidates = KM_RECORD_MAX_CANDIDATES + 1;
    cr_assert_eq(km_record_writer_submit_decision(w, &bad), KM_ERR_TOO_LARGE);
    owner_elsewhere_case(&bad, c);
    bad.candidates = NULL;
    cr_assert_eq(km_record_writer_submit_decision(w, &bad), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_record_writer_submit_decision(w, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_record_writer_submit_outcome(NULL, NULL), KM_ERR_NULL_POINTER);
    km_record_writer_destroy(w);

    size_t n;
    char *data = read_file(path, &n);
    cr_assert(data);
    char *at = data;
    for (size_t i = 0; i < n_expected; i++) {
        size_t len = strlen(expected[i]);
        KM_CHECK(strncmp(at, expected[i], len) == 0 && at[len] == '\n', "line %zu differs:\n%.200s\n%.200s",
                 i, at, expected[i]);
        at += len + 1;
        free(expected[i]);
    }
    cr_assert_eq((size_t)(at - data), n, "extra bytes after the expected lines");
    free(data);
    remove_dir(dir);
}

/* Records are written without jansson; jansson judges them. Random byte strings as an id: a line
 * comes out exactly when jansson takes the string as UTF-8, and reads back as the same bytes.
 * Reals from subnormal to huge, negative, integral and not: each reads back as a JSON real within
 * the 16 significant digits written. */
Test(records, strings_and_reals_read_back_through_jansson, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    static const unsigned char interesting[] = {0x00, 0x01, 0x1f, 0x20, '"', '\\', '/', 0x7f,
                                                0x80, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xed,
                                                0xef, 0xf0, 0xf4, 0xf5, 0xff, 'a', 0xa0, 0x9f};
    /* Valid sequences at the edges (U+007F, U+0080, U+07FF, U+0800, U+D7FF, U+E000, U+FFFF,
     * U+10000, U+10FFFF) and invalid ones (overlong, surrogate, past U+10FFFF, lone or missing
     * continuation bytes, 0xF5). */
    static const char *const valid[] = {"a", "\"", "\\", "\n", "\x01", "\x7f", "\xc2\x80",
                                        "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf", "\xee\x80\x80",
                                        "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf"};
    static const char *const invalid[] = {"\xc0\xaf", "\xc1\xbf", "\xe0\x80\xaf", "\xed\xa0\x80",
                                          "\xed\xbf\xbf", "\xf0\x80\x80\xaf", "\xf4\x90\x80\x80",
                                          "\xf5\x80\x80\x80", "\x80", "\xbf", "\xe6\x97", "\xff"};
    int accepted = 0, refused = 0;
    for (int i = 0; i < 20000; i++) {
        char id[64];
        id[0] = '\0';
        if (i % 2) { /* pieces: valid, with an invalid one in a third of the cases */
            uint32_t pieces = 1 + km_rng_below(&rng, 8);
            uint32_t bad_at = km_rng_percent(&rng, 33) ? km_rng_below(&rng, pieces) : pieces;
            for (uint32_t k = 0; k < pieces; k++)
                strcat(id, k == bad_at ? invalid[km_rng_below(&rng, sizeof invalid / sizeof *invalid)]
                                       : valid[km_rng_below(&rng, sizeof valid / sizeof *valid)]);
        } else { /* random bytes */
            uint32_t n = 1 + km_rng_below(&rng, 16);
            for (uint32_t k = 0; k < n; k++) {
                unsigned char c = km_rng_percent(&rng, 60)
                                      ? interesting[km_rng_below(&rng, sizeof interesting)]
                                      : (unsigned char)km_rng_below(&rng, 256);
                id[k] = (char)(c ? c : 'x'); /* C strings: no NUL inside */
            }
            id[n] = '\0';
        }
        km_decision_record r;
        km_record_candidate cands[2];
        owner_elsewhere_case(&r, cands);
        r.common.attempt_id = id;
        r.load_value = (km_rng_below(&rng, 2) ? -1.0 : 1.0) *
                       ldexp((double)km_rng_below(&rng, 1u << 30) + 0.5,
                             (int)km_rng_below(&rng, 2090) - 1100); /* finite: < 2^1020 */
        char *line = NULL, error[256];
        size_t len = 0;
        int rc = km_decision_record_format(&r, &line, &len, error, sizeof error);
        json_t *as_jansson = json_string(id);
        if (!as_jansson) {
            cr_assert_eq(rc, KM_ERR_INVALID_ARGUMENT, "case %d: jansson refuses the id, we did not", i);
            cr_assert(strstr(error, "attempt_id") && strstr(error, "UTF-8"), "%s", error);
            refused++;
            continue;
        }
        json_decref(as_jansson);
        cr_assert_eq(rc, KM_OK, "case %d: jansson takes the id, we refused: %s", i, error);
        json_error_t err;
        json_t *o = json_loadb(line, len, 0, &err);
        cr_assert_not_null(o, "case %d: %s in %s", i, err.text, line);
        cr_assert_str_eq(json_string_value(json_object_get(o, "attempt_id")), id, "case %d", i);
        json_t *v = json_object_get(json_object_get(json_object_get(o, "decision"), "load"), "value");
        cr_assert(json_is_real(v), "case %d: the value reads back as a real: %s", i, line);
        double got = json_real_value(v);
        cr_assert(fabs(got - r.load_value) <= 1e-15 * fabs(r.load_value) ||
                      (fabs(r.load_value) < 1e-300 && fabs(got - r.load_value) < 1e-310),
                  "case %d: %.17g read back as %.17g", i, r.load_value, got);
        json_decref(o);
        free(line);
        accepted++;
    }
    cr_assert(accepted > 2000 && refused > 2000, "accepted %d, refused %d", accepted, refused);
    /* And the real formats at their edges. */
    static const double reals[] = {0.0, 1.0, -1.0, 0.1, 1e21, 1e-7, 123456789012345678.0,
                                   5e-324, 1.7976931348623157e308, -2.5e-300, 1e16, 1e15,
                                   -0.0, 9007199254740991.0, -9007199254740991.0,
                                   9007199254740992.0, 113462.0, -7.0};
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++) {
        km_decision_record r;
        km_record_candidate cands[2];
        owner_elsewhere_case(&r, cands);
        r.load_value = reals[i];
        char *line = NULL;
        size_t len = 0;
        cr_assert_eq(km_decision_record_format(&r, &line, &len, NULL, 0), KM_OK);
        json_t *o = json_loadb(line, len, 0, NULL);
        json_t *v = json_object_get(json_object_get(json_object_get(o, "decision"), "load"), "value");
        cr_assert(json_is_real(v), "%.17g: %s", reals[i], line);
        cr_assert(json_real_value(v) == reals[i] ||
                      fabs(json_real_value(v) - reals[i]) <= 1e-15 * fabs(reals[i]),
                  "%.17g read back as %.17g", reals[i], json_real_value(v));
        /* Whole numbers below 2^53 are written exactly, as every digit and ".0"; -0.0 keeps its
         * sign. */
        char whole[48];
        snprintf(whole, sizeof whole, "\"value\":%.0f.0,", reals[i]);
        if (fabs(reals[i]) < 9007199254740992.0 && reals[i] == floor(reals[i]))
            cr_assert_not_null(strstr(line, whole), "%s not in %s", whole, line);
        json_decref(o);
        free(line);
    }
}

/* Every string of a queued outcome is copied at submit, dispatched_worker included: the server
 * submits the outcome from an attempt it frees right after (attempt_forget), so a borrowed
 * pointer would be read after free by the writer thread. */
Test(records, queued_outcome_copies_dispatched_worker, .timeout = 30)
{
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    cfg.flush_interval_ms = 1000;
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    static gen g;
    km_rng_init(&g.rng, km_test_seed());
    km_outcome_record o;
    gen_outcome(&g, &o);
    char *dispatched = strdup("worker-b");
    cr_assert_not_null(dispatched);
    o.dispatched_worker = dispatched;
    char *expected;
    size_t len;
    cr_assert_eq(km_outcome_record_format(&o, &expected, &len, NULL, 0), KM_OK);
    cr_assert_eq(km_record_writer_submit_outcome(w, &o), KM_OK);
    memset(dispatched, 'Q', strlen(dispatched)); /* the caller reuses its memory at once */
    free(dispatched);
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    km_record_writer_destroy(w);
    size_t n;
    char *data = read_file(path, &n);
    cr_assert_not_null(data);
    cr_assert_eq(n, len + 1, "%s", data);
    cr_assert(strncmp(data, expected, len) == 0, "written:\n%s\nexpected:\n%s", data, expected);
    free(expected);
    free(data);
    remove_dir(dir);
}

/* The directory (or the file) removed while the file is open: writes to the unlinked file would
 * succeed and be counted as written although no one can read them. They are failed instead, and
 * writing resumes in a new file once the directory is back. */
Test(records, removed_directory_counts_failures_and_recovers, .timeout = 30)
{
    char dir[64], path[160], sub[128];
    make_temp_dir(dir);
    snprintf(sub, sizeof sub, "%s/logs", dir);
    snprintf(path, sizeof path, "%s/r.jsonl", sub);
    cr_assert_eq(mkdir(sub, 0700), 0);
    km_record_writer_config cfg;
    log_capture log;
    writer_config(&cfg, path, &log);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    cr_assert_eq(km_record_writer_submit(w, "{\"a\":1}", 7), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);

    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", sub);
    cr_assert_eq(system(cmd), 0);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(km_record_writer_submit(w, "{\"lost\":1}", 10), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_ERR_IO, "lines to a removed file are not written");
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 1);
    cr_assert_eq(s.failed, 4);

    cr_assert_eq(mkdir(sub, 0700), 0);
    cr_assert_eq(km_record_writer_submit(w, "{\"b\":2}", 7), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    char *data = read_file(path, NULL);
    cr_assert_not_null(data, "writing resumes in a new file");
    cr_assert_str_eq(data, "{\"b\":2}\n");
    free(data);

    /* the file alone removed (or moved away): the next lines start a new one */
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(km_record_writer_submit(w, "{\"c\":3}", 7), KM_OK);
    cr_assert_eq(km_record_writer_flush(w, 10000), KM_OK);
    data = read_file(path, NULL);
    cr_assert_not_null(data);
    cr_assert_str_eq(data, "{\"c\":3}\n");
    free(data);
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.written, 3);
    km_record_writer_destroy(w);
    remove_dir(dir);
}

/* Queued records with strings that are not UTF-8 (the wire does not force them to be) are kept:
 * the writer's copy replaces each ill-formed sequence (its maximal subpart) by U+FFFD, so the line
 * equals what the format functions make of the cleaned strings and parses. */
Test(records, queued_records_replace_bad_utf8_instead_of_losing_the_record, .timeout = 30)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"plain", "plain"},
        {"caf\xc3\xa9", "caf\xc3\xa9"},
        {"\xe9t\xe9", "\xef\xbf\xbdt\xef\xbf\xbd"},               /* Latin-1 */
        {"a\xc3", "a\xef\xbf\xbd"},                             /* cut 2-byte sequence */
        {"\xf0\x9f\x98", "\xef\xbf\xbd"},                        /* cut 4-byte: one subpart */
        {"\xf0\x9f\x98\x80!", "\xf0\x9f\x98\x80!"},                /* whole: kept */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},      /* surrogate: 3 */
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},                    /* overlong */
        {"\xff\xfe", "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\x80x", "\xef\xbf\xbdx"},
        {"\xe0\xa0", "\xef\xbf\xbd"},
        {"\x01\"\\", "\x01\"\\"},
    };
    size_t n_cases = sizeof cases / sizeof cases[0];
    char dir[64], path[128];
    make_temp_dir(dir);
    snprintf(path, sizeof path, "%s/r.jsonl", dir);
    km_record_writer_config cfg;
    writer_config(&cfg, path, NULL);
    km_record_writer *w;
    cr_assert_eq(km_record_writer_create(&cfg, &w), KM_OK);
    char **expected = calloc(2 * n_cases, sizeof *expected);
    for (size_t i = 0; i < n_cases; i++) {
        km_decision_record d;
        km_record_candidate c[2];
        owner_elsewhere_case(&d, c);
        d.common.request_id = cases[i].in;
        d.common.attempt_id = cases[i].in;
        c[1].worker = cases[i].in;
        cr_assert_eq(km_record_writer_submit_decision(w, &d), KM_OK);
        d.common.request_id = cases[i].out;
        d.common.attempt_id = cases[i].out;
        c[1].worker = cases[i].out;
        size_t len;
        cr_assert_eq(km_decision_record_format(&d, &expected[2 * i], &len, NULL, 0), KM_OK, "case %zu", i);

        km_outcome_record o;
        km_outcome_record_init(&o);
        km_outcome_record_from_decision(&o, &d);
        o.common.request_id = cases[i].in;
        o.outcome = KM_RECORD_OUTCOME_ERROR;
        o.error = cases[i].in;
        o.finish_reason = cases[i].in;
        o.dispatched_worker = cases[i].in;
        cr_assert_eq(km_record_writer_submit_outcome(w, &o), KM_OK);
        o.common.request_id = cases[i].out;
        o.error = cases[i].out;
        o.finish_reason = cases[i].out;
        o.dispatched_worker = cases[i].out;
        cr_assert_eq(km_outcome_record_format(&o, &expected[2 * i + 1], &len, NULL, 0), KM_OK, "case %zu", i);
    }
    cr_assert_eq(km_record_writer_flush(w, 20000), KM_OK);
    km_record_writer_counters s;
    km_record_writer_stats(w, &s);
    cr_assert_eq(s.invalid, 0);
    cr_assert_eq(s.written, 2 * n_cases);
    km_record_writer_destroy(w);
    char *data = read_file(path, NULL);
    cr_assert_not_null(data);
    char *at = data;
    for (size_t i = 0; i < 2 * n_cases; i++) {
        size_t len = strlen(expected[i]);
        cr_assert(strncmp(at, expected[i], len) == 0 && at[len] == '\n', "line %zu:\n%.300s\nexpected\n%s",
                  i, at, expected[i]);
        json_t *o = json_loadb(at, len, 0, NULL);
        cr_assert_not_null(o, "line %zu parses", i);
        json_decref(o);
        at += len + 1;
        free(expected[i]);
    }
    cr_assert_eq(*at, '\0');
    free(expected);
    free(data);
    remove_dir(dir);
}
