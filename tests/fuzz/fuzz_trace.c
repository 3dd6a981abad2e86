/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the Mooncake trace loader, km_trace_load_mooncake (src/sim/trace.c), on a file
 * of fuzzed bytes (a memfd, read through /proc/self/fd), and the expansion of what it loaded.
 *
 * Contracts checked: a failure has a negative code, a non-empty message and a zeroed trace; a
 * success has at least one request, timestamps that never go backwards and stay within
 * KM_TRACE_MAX_TIMESTAMP_MS, at least one id per request, id lists that tile the pool in order,
 * and chain hashes (16-token blocks, 16 tokens per id to keep the work small) as many as
 * km_trace_max_blocks says, equal for equal requests. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvmatch/error.h"
#include "sim/trace.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("trace", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(write(fd, data, size) == (ssize_t)size);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    km_trace t;
    memset(&t, 0xa5, sizeof t); /* must be reset */
    char err[256] = "";
    int rc = km_trace_load_mooncake(path, &t, err, sizeof err);
    close(fd);
    if (rc != KM_OK) {
        CHECK(rc < 0);
        CHECK(err[0] != '\0');
        CHECK(t.requests == NULL && t.n_requests == 0 && t.id_pool == NULL && t.n_ids == 0);
        return 0;
    }
    CHECK(err[0] == '\0');
    CHECK(t.n_requests >= 1 && t.requests);
    size_t at = 0;
    uint64_t *h = NULL, *h0 = NULL;
    for (size_t i = 0; i < t.n_requests; i++) {
        const km_trace_request *r = &t.requests[i];
        CHECK(r->timestamp_ms <= KM_TRACE_MAX_TIMESTAMP_MS);
        CHECK(i == 0 || r->timestamp_ms >= t.requests[i - 1].timestamp_ms);
        CHECK(r->n_ids >= 1 && r->ids == t.id_pool + at);
        at += r->n_ids;
        CHECK(at <= t.n_ids);
        uint32_t max = km_trace_max_blocks(r, 16, 16), n = UINT32_MAX;
        h = realloc(h, (max + 1) * sizeof *h);
        CHECK(h);
        CHECK(km_trace_chain_hashes(r, 16, 16, h, &n) == KM_OK);
        CHECK(n == max);
        if (i == 0) {
            h0 = malloc((max + 1) * sizeof *h0);
            CHECK(h0);
            memcpy(h0, h, max * sizeof *h);
        } else if (r->n_ids == t.requests[0].n_ids && r->input_length == t.requests[0].input_length &&
                   !memcmp(r->ids, t.requests[0].ids, r->n_ids * sizeof *r->ids)) {
            CHECK(!memcmp(h, h0, max * sizeof *h));
        }
    }
    CHECK(at == t.n_ids);
    free(h);
    free(h0);
    km_trace_free(&t);
    CHECK(t.requests == NULL && t.n_requests == 0);
    return 0;
}
