/* SPDX-License-Identifier: Apache-2.0 */
/* The router protocol's frame reader (include/kvmatch/protocol.h, "frame reader"): an arbitrary
 * byte stream cut into length-prefixed frames, in memory bounded by the maximum frame size. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/protocol.h"
#include "base/error_detail.h"
#include "service/protocol_internal.h"

#define READER_KEEP_BYTES    ((size_t)64 << 10) /* buffer kept between frames */
#define READER_MIN_BYTES     ((size_t)4 << 10)

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
