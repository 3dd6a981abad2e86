/* The Mooncake trace loader (src/trace.h) on bad input: every malformed, out-of-range or oversize
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
#include "trace.h"

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
