/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the records reader of `kvmatch analyze` (src/analyze/join.c): the input is cut
 * at its first 0x00 byte into two JSONL files (rotated files join across), each added with
 * km_analysis_add_file, then the analysis is finished and rendered as text, JSON and HTML.
 * The files live in memfds, read through /proc/self/fd.
 *
 * Contracts checked: bad lines are never an error (add_file and finish return KM_OK), every
 * rendering succeeds, and the JSON rendering is valid JSON (jansson parses it). */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "analyze/analyze.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

static int add(km_analysis *a, const uint8_t *data, size_t size)
{
    int fd = memfd_create("records", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(write(fd, data, size) == (ssize_t)size);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rc = km_analysis_add_file(a, path);
    close(fd);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    km_analysis_config cfg = {.max_line_bytes = 4096, .max_listed = 3, .chart_buckets = 7};
    km_analysis *a = NULL;
    CHECK(km_analysis_create(&cfg, &a) == KM_OK);
    const uint8_t *cut = memchr(data, 0, size);
    size_t first = cut ? (size_t)(cut - data) : size;
    CHECK(add(a, data, first) == KM_OK);
    if (cut)
        CHECK(add(a, cut + 1, size - first - 1) == KM_OK);
    CHECK(km_analysis_finish(a) == KM_OK);
    CHECK(km_analysis_summary_get(a) != NULL);
    km_text t;
    km_text_init(&t, 0);
    CHECK(km_analysis_render_text(a, &t) == KM_OK);
    km_text_clear(&t);
    CHECK(km_analysis_render_json(a, &t) == KM_OK);
    json_error_t err;
    json_t *root = json_loads(km_text_cstr(&t), 0, &err);
    if (!root) {
        fprintf(stderr, "analysis JSON does not parse: %s at %d:%d\n%s\n", err.text, err.line,
                err.column, km_text_cstr(&t));
        abort();
    }
    json_decref(root);
    km_text_clear(&t);
    CHECK(km_analysis_render_html(a, &t) == KM_OK);
    km_text_free(&t);
    km_analysis_destroy(a);
    return 0;
}
