/* SPDX-License-Identifier: Apache-2.0 */
/* The Mooncake trace loader (src/sim/trace.h) on bad input: every malformed, out-of-range or oversize
 * file fails with an error code and a message naming the line (and the field), reads no more of
 * an oversize line than the limit allows, and never yields a trace the simulator would replay
 * wrongly. Files are temporary and removed by each test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "kvmatch/error.h"
#include "sim/sim.h"
#include "sim/workload.h"
#include "sim/trace.h"

#define LINE(ts, in, ids) \
    "{\"timestamp\": " ts ", \"input_length\": " in ", \"output_length\": 7, \"hash_ids\": " ids "}\n"

/* A temporary file holding n bytes of data; returns its path (free it with drop_file). */
static char *temp_file(const void *data, size_t n)
{
    char *path = strdup("/tmp/km_test_trace_XXXXXX");
    cr_assert(path);
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, data, n), (ssize_t)n);
    cr_assert_eq(close(fd), 0);
    return path;
}

static void drop_file(char *path)
{
    unlink(path);
    free(path);
}

/* Load a trace held in a string; the trace is freed unless out is given. */
static int load_string(const char *text, km_trace *out, char *err, size_t err_size)
{
    char *path = temp_file(text, strlen(text));
    km_trace t;
    int rc = km_trace_load_mooncake(path, &t, err, err_size);
    drop_file(path);
    if (out)
        *out = t;
    else
        km_trace_free(&t);
    return rc;
}

static void quiet(void *user, const char *line)
{
    (void)user;
    (void)line;
}

static long max_rss_kb(void)
{
    struct rusage ru;
    cr_assert_eq(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_maxrss;
}

/* A line far longer than the 16 MiB limit is refused after reading at most the limit: memory does
 * not grow with the line (getline would have buffered all of it first). */
Test(trace, oversize_line_is_refused_within_the_limit, .timeout = 30)
{
    static const char head[] = LINE("0", "5", "[1]");
    char *path = temp_file(head, sizeof head - 1);
    FILE *f = fopen(path, "r+");
    cr_assert(f);
    /* 256 MiB without a newline, sparse: cheap to write, costly to buffer. */
    cr_assert_eq(ftruncate(fileno(f), (off_t)(sizeof head - 1) + (off_t)(256 << 20)), 0);
    fclose(f);
    long before = max_rss_kb();
    km_trace t;
    char err[256] = "";
    int rc = km_trace_load_mooncake(path, &t, err, sizeof err);
    long grown_mb = (max_rss_kb() - before) / 1024;
    drop_file(path);
    cr_assert_eq(rc, KM_ERR_TOO_LARGE, "%s", err);
    cr_assert(strstr(err, ":2: line longer than"), "%s", err);
    cr_assert_eq(t.n_requests, 0);
    cr_assert_lt(grown_mb, 64, "loading grew the resident set by %ld MiB", grown_mb);
}

/* Arrivals are replayed in file order: a timestamp earlier than the line before is refused, not
 * replayed as virtual time running backwards (the simulator did, and reported a makespan that
 * ignored it). */
Test(trace, timestamp_going_backwards_is_refused, .timeout = 10)
{
    char err[256] = "";
    int rc = load_string(LINE("10", "5", "[1]") LINE("10", "5", "[1]") LINE("9", "5", "[1]"),
                         NULL, err, sizeof err);
    cr_assert_eq(rc, KM_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, ":3: field \"timestamp\""), "%s", err);
    cr_assert(strstr(err, "before"), "%s", err);

    km_sim_config cfg;
    km_sim_config_init(&cfg);
    cfg.log = quiet;
    static const char text[] = LINE("3000", "1000", "[1, 2]") LINE("1000", "1000", "[3, 4]");
    char *path = temp_file(text, sizeof text - 1);
    cfg.trace_path = path;
    km_sim_result res[KM_SIM_MAX_POLICIES];
    char why[512] = "";
    rc = km_sim_run(&cfg, res, NULL, why, sizeof why);
    drop_file(path);
    cr_assert_eq(rc, KM_ERR_PARSE, "%s", why);
    cr_assert(strstr(why, ":2: field \"timestamp\""), "%s", why);
}

/* Timestamps stay within KM_TRACE_MAX_TIMESTAMP_MS (2^53 ms), so their microseconds fit the
 * simulator's uint64_t clock; beyond it the clock wrapped and a later request arrived first. A
 * real one at the old bound (2^63, past it by one) was accepted too. */
Test(trace, timestamp_beyond_the_limit_is_refused, .timeout = 10)
{
    char err[256] = "";
    km_trace t;
    cr_assert_eq(load_string(LINE("9007199254740992", "5", "[1]"), &t, err, sizeof err), KM_OK,
                 "%s", err);
    cr_assert_eq(t.requests[0].timestamp_ms, KM_TRACE_MAX_TIMESTAMP_MS);
    km_trace_free(&t);
    static const char *const bad[] = {
        LINE("9007199254740993", "5", "[1]"),
        LINE("0", "5", "[1]") LINE("18446744073709552", "5", "[1]"),
        LINE("9223372036854775807", "5", "[1]"),
        LINE("9223372036854775808.0", "5", "[1]"),
        LINE("1e300", "5", "[1]"),
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        cr_assert_eq(load_string(bad[i], NULL, err, sizeof err), KM_ERR_PARSE, "case %zu: %s", i,
                     err);
        cr_assert(strstr(err, "field \"timestamp\": value out of range"), "case %zu: %s", i, err);
    }
}

/* --time-scale cannot push an arrival past the limit either (llround of a value beyond int64 is
 * undefined, and the clock would wrap). */
Test(trace, time_scale_cannot_pass_the_limit, .timeout = 10)
{
    char err[256] = "";
    km_trace t;
    cr_assert_eq(load_string(LINE("0", "5", "[1]") LINE("1000000000000", "5", "[1]"), &t, err,
                             sizeof err), KM_OK, "%s", err);
    cr_assert_eq(km_sim_trace_trim(&t, 0, 1e7), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_trace_trim(&t, 0, 1000.0), KM_OK);
    cr_assert_eq(t.requests[1].timestamp_ms, UINT64_C(1000000000000000));
    km_trace_free(&t);
}

/* Run the simulator (one policy, two workers) on a trace held in a string. */
static int sim_string(const char *text, char *why, size_t why_size)
{
    km_sim_config cfg;
    km_sim_config_init(&cfg);
    cfg.log = quiet;
    cfg.workers = 2;
    cfg.policies[0] = "kv";
    cfg.n_policies = 1;
    char *path = temp_file(text, strlen(text));
    cfg.trace_path = path;
    km_sim_result res[KM_SIM_MAX_POLICIES];
    int rc = km_sim_run(&cfg, res, NULL, why, why_size);
    drop_file(path);
    return rc;
}

/* An empty file, or one of blank lines only, is not a trace: sim replayed it as zero requests
 * and printed a table of zeros with exit status 0. */
Test(trace, file_without_requests_is_refused, .timeout = 20)
{
    static const char *const empty[] = {"", "\n", " \r\n\t\n"};
    for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
        char err[256] = "";
        cr_assert_eq(load_string(empty[i], NULL, err, sizeof err), KM_ERR_PARSE, "case %zu: %s",
                     i, err);
        cr_assert(strstr(err, "no requests"), "case %zu: %s", i, err);
        char why[512] = "";
        cr_assert_eq(sim_string(empty[i], why, sizeof why), KM_ERR_PARSE, "case %zu: %s", i, why);
        cr_assert(strstr(why, "no requests"), "case %zu: %s", i, why);
    }
}

/* Case i (of n) is refused with KM_ERR_PARSE by the loader and by sim alike, each naming line
 * i + 1 and `field_says` ("\"name\": what"). */
static void refused_at_their_line(const char *const *cases, size_t n, const char *field_says)
{
    for (size_t i = 0; i < n; i++) {
        char err[256] = "", where[96];
        snprintf(where, sizeof where, ":%zu: field %s", i + 1, field_says);
        cr_assert_eq(load_string(cases[i], NULL, err, sizeof err), KM_ERR_PARSE, "case %zu: %s",
                     i, err);
        cr_assert(strstr(err, where), "case %zu: %s", i, err);
        char why[512] = "";
        cr_assert_eq(sim_string(cases[i], why, sizeof why), KM_ERR_PARSE, "case %zu: %s", i, why);
        cr_assert(strstr(why, where), "case %zu: %s", i, why);
    }
}

/* A request without ids has no prompt to expand: refused at its line. sim failed on it with
 * "KM_ERR_NULL_POINTER: request 0: tokens" when it came first, and routed the previous request's
 * first token for it otherwise. */
Test(trace, request_without_ids_is_refused, .timeout = 20)
{
    static const char *const cases[] = {
        LINE("0", "100", "[]") LINE("5", "100", "[1]"),
        LINE("0", "100", "[1]") LINE("5", "100", "[]"),
    };
    refused_at_their_line(cases, sizeof cases / sizeof cases[0], "\"hash_ids\": empty");
}

/* A trace line of n ids (0, 1, ..., n - 1) and the given input length, at timestamp ts. */
static char *line_with_ids(uint64_t ts, uint32_t input_length, uint32_t n)
{
    size_t cap = 128 + (size_t)n * 12, at = 0;
    char *s = malloc(cap);
    cr_assert(s);
    at += (size_t)snprintf(s + at, cap - at,
                           "{\"timestamp\": %llu, \"input_length\": %u, \"output_length\": 4, "
                           "\"hash_ids\": [", (unsigned long long)ts, input_length);
    for (uint32_t i = 0; i < n; i++)
        at += (size_t)snprintf(s + at, cap - at, i ? ", %u" : "%u", i);
    snprintf(s + at, cap - at, "]}\n");
    return s;
}

/* sim expands only the ids that input_length uses: a request of 2^18 ids but 1000 tokens cost
 * 2^27 expanded tokens (512 MiB written, 1 GiB of chain slots) before it was cut to 1000. */
Test(trace, sim_expands_only_the_ids_input_length_uses, .timeout = 60)
{
    char why[512] = "";
    char *small = line_with_ids(0, 1000, 2);
    cr_assert_eq(sim_string(small, why, sizeof why), KM_OK, "%s", why); /* the baseline */
    free(small);
    char *big = line_with_ids(0, 1000, 1u << 18);
    long before = max_rss_kb();
    int rc = sim_string(big, why, sizeof why);
    long grown_mb = (max_rss_kb() - before) / 1024;
    free(big);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_lt(grown_mb, 128, "the run grew the resident set by %ld MiB", grown_mb);
}

/* Token counts are integers: a fractional input_length or output_length is refused, not truncated
 * (5.7 tokens became 5). An integral real (5.0) and a real timestamp (truncated to the
 * millisecond, as some trace tools write them) still load. */
Test(trace, fractional_token_count_is_refused, .timeout = 10)
{
    char err[256] = "";
    cr_assert_eq(load_string(LINE("0", "5.7", "[1]"), NULL, err, sizeof err), KM_ERR_PARSE, "%s",
                 err);
    cr_assert(strstr(err, ":1: field \"input_length\": not an integer"), "%s", err);
    err[0] = '\0';
    cr_assert_eq(load_string("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 0.5, "
                             "\"hash_ids\": [1]}\n", NULL, err, sizeof err), KM_ERR_PARSE, "%s",
                 err);
    cr_assert(strstr(err, ":1: field \"output_length\": not an integer"), "%s", err);
    km_trace t;
    cr_assert_eq(load_string(LINE("12.9", "5.0", "[1]"), &t, err, sizeof err), KM_OK, "%s", err);
    cr_assert_eq(t.requests[0].timestamp_ms, 12);
    cr_assert_eq(t.requests[0].input_length, 5);
    km_trace_free(&t);
}

/* A field given twice is ambiguous: refused instead of silently taking the last one. */
Test(trace, duplicate_field_is_refused, .timeout = 10)
{
    char err[256] = "";
    cr_assert_eq(load_string("{\"timestamp\": 0, \"timestamp\": 7, \"input_length\": 5, "
                             "\"output_length\": 1, \"hash_ids\": [1]}\n", NULL, err, sizeof err),
                 KM_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, ":1: invalid JSON at column "), "%s", err);
    cr_assert(strstr(err, "duplicate object key"), "%s", err);
}

/* A number too large for any integer is refused by the JSON parser itself, before any field is
 * checked: the message still says where, and in which field. */
Test(trace, an_integer_too_large_for_json_names_its_field, .timeout = 10)
{
    char err[256] = "";
    cr_assert_eq(load_string("{\"timestamp\": 99999999999999999999999, \"input_length\": 5, "
                             "\"output_length\": 1, \"hash_ids\": [1]}\n", NULL, err, sizeof err),
                 KM_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, ":1: invalid JSON at column 37 (field \"timestamp\"): too big integer"),
              "%s", err);
    cr_assert_eq(load_string(LINE("0", "5", "[1]") "{\"timestamp\": 1, \"input_length\": 5, "
                             "\"output_length\": 1, \"hash_ids\": [1, 184467440737095516150]}\n",
                             NULL, err, sizeof err),
                 KM_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, ":2: invalid JSON at column "), "%s", err);
    cr_assert(strstr(err, "(field \"hash_ids\"): too big integer"), "%s", err);
    cr_assert_eq(load_string("{\"timestamp\" 1}\n", NULL, err, sizeof err), KM_ERR_PARSE);
    cr_assert(strstr(err, ":1: invalid JSON at column ") && !strstr(err, "(field"), "%s", err);
}

/* A byte order mark opening the file is skipped: the trace is the one without it. Anywhere else it
 * is not JSON, refused naming its line. */
Test(trace, a_byte_order_mark_opens_a_file_and_nothing_else, .timeout = 10)
{
    const char *body = LINE("0", "48", "[1, 2, 3]") LINE("5", "32", "[1, 4]");
    char with_mark[256], err[256] = "";
    snprintf(with_mark, sizeof with_mark, "\xEF\xBB\xBF%s", body);
    km_trace plain, marked;
    cr_assert_eq(load_string(body, &plain, err, sizeof err), KM_OK, "%s", err);
    cr_assert_eq(load_string(with_mark, &marked, err, sizeof err), KM_OK, "%s", err);
    cr_assert_eq(marked.n_requests, plain.n_requests);
    for (size_t i = 0; i < plain.n_requests; i++) {
        const km_trace_request *a = &plain.requests[i], *b = &marked.requests[i];
        cr_assert(a->timestamp_ms == b->timestamp_ms && a->input_length == b->input_length &&
                      a->output_length == b->output_length && a->n_ids == b->n_ids &&
                      !memcmp(a->ids, b->ids, a->n_ids * sizeof *a->ids),
                  "request %zu differs", i);
    }
    km_trace_free(&plain);
    km_trace_free(&marked);
    char late[256];
    snprintf(late, sizeof late, "%s\xEF\xBB\xBF%s", LINE("0", "48", "[1, 2, 3]"),
             LINE("5", "32", "[1, 4]"));
    cr_assert_eq(load_string(late, NULL, err, sizeof err), KM_ERR_PARSE);
    cr_assert(strstr(err, ":2: invalid JSON"), "%s", err);
}

/* A prompt longer than the server takes (max_tokens_per_route, 2^20 by default) is expanded only
 * one token past that limit, so the server refuses the route as too large and the run goes on:
 * 2^17 ids of 2^26 tokens are not expanded whole (64 M tokens, 768 MiB of tokens and chain hashes)
 * before the route is refused anyway. */
Test(trace, sim_expands_no_more_than_the_server_takes, .timeout = 60)
{
    char why[512] = "";
    char *big = line_with_ids(0, 1u << 26, 1u << 17);
    long before = max_rss_kb();
    int rc = sim_string(big, why, sizeof why);
    long grown_mb = (max_rss_kb() - before) / 1024;
    free(big);
    cr_assert_eq(rc, KM_OK, "%s", why);
    cr_assert_lt(grown_mb, 128, "the run grew the resident set by %ld MiB", grown_mb);
}

/* Each hash id stands for one 512-token block of the prompt, so the ids cover at most 512 tokens
 * each: a longer input_length names tokens the trace does not have. Such a line is refused,
 * naming the line and the field (the engines would have run fewer tokens than the statistics,
 * the TTFT floor and the records counted); ids past input_length are fine. */
Test(trace, input_length_past_the_ids_is_refused, .timeout = 20)
{
    char err[256] = "";
    cr_assert_eq(load_string(LINE("0", "5", "[1]") LINE("1", "1025", "[1, 2]"), NULL, err,
                             sizeof err),
                 KM_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, ":2: field \"input_length\": 1025 tokens, more than the 2 hash_ids "
                          "cover (512 tokens each)"), "%s", err);
    char why[512] = "";
    cr_assert_eq(sim_string(LINE("0", "20000", "[7]"), why, sizeof why), KM_ERR_PARSE, "%s", why);
    cr_assert(strstr(why, ":1: field \"input_length\""), "%s", why);
    km_trace t;
    cr_assert_eq(load_string(LINE("0", "1024", "[1, 2]") LINE("1", "100", "[1, 2, 3]"), &t, err,
                             sizeof err),
                 KM_OK, "%s", err);
    cr_assert_eq(t.n_requests, 2);
    km_trace_free(&t);
}

/* A request of input_length 0 has no prompt: an engine runs none (vLLM refuses an empty prompt),
 * so the line is refused, naming the line and the field, as an empty hash_ids is. Replaying it
 * would run a token that its FINISHED (prompt_tokens 0) and the workload statistics do not count.
 * One token is a prompt. */
Test(trace, empty_prompt_is_refused, .timeout = 20)
{
    static const char *const cases[] = {
        LINE("0", "0", "[1]") LINE("5", "100", "[1]"),
        LINE("0", "100", "[1]") LINE("5", "0", "[1, 2]"),
    };
    refused_at_their_line(cases, sizeof cases / sizeof cases[0], "\"input_length\": 0 tokens");
    km_trace t;
    char err[256] = "";
    cr_assert_eq(load_string(LINE("0", "1", "[1]"), &t, err, sizeof err), KM_OK, "%s", err);
    cr_assert_eq(t.requests[0].input_length, 1);
    km_trace_free(&t);
}
