/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the router wire protocol (include/kvmatch/protocol.h): the frame reader
 * and the message decoder on untrusted bytes. `make fuzz` builds and runs it (docs/FUZZING.md).
 *
 * Contracts checked, beyond "no crash, leak or undefined behaviour":
 *  - the input as one payload: a failed decode returns a negative code and a non-empty message;
 *    a success leaves the message "" and, when every item decoded, re-encodes, and that frame
 *    decodes again and re-encodes to the same bytes (decode and encode agree on every field);
 *  - the input as a byte stream cut into chunks (sizes taken from the input): the frame reader
 *    takes at most what it is given, makes progress while healthy, takes a chunk whole unless a
 *    frame ends in it and then stops at that frame's end, holds (km_frame_reader_pending) exactly
 *    the bytes of the frame it is assembling, 0 between frames, a frame whose length prefix is
 *    within 1..max_frame_bytes; every payload it hands out is that frame's bytes and is decoded
 *    as above; it fails only on a length prefix of 0 (KM_ERR_PROTOCOL) or over max_frame_bytes
 *    (KM_ERR_TOO_LARGE), or without memory, and once failed stays failed with the same status and
 *    a non-empty message;
 *  - the same with tight limits, so the limit paths run on small inputs. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/protocol.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

static km_protocol_decoder *dec_default, *dec_tight, *dec_check;

static void init(void)
{
    if (dec_default)
        return;
    km_protocol_limits tight;
    km_protocol_limits_init(&tight);
    tight.max_frame_bytes = 512;
    tight.max_objects = 64;
    tight.max_batch_items = 3;
    tight.max_tokens_per_route = 8;
    tight.max_hashes_per_route = 4;
    tight.max_candidates = 2;
    tight.max_params = 2;
    tight.max_string_bytes = 8;
    CHECK(km_protocol_decoder_create(NULL, &dec_default) == KM_OK);
    CHECK(km_protocol_decoder_create(&tight, &dec_tight) == KM_OK);
    CHECK(km_protocol_decoder_create(NULL, &dec_check) == KM_OK);
}

/* True when every item of a batch decoded (only then is the message fit to re-encode). */
static bool all_items_ok(const km_message *m)
{
    switch (m->type) {
    case KM_MESSAGE_ROUTE:
        for (uint32_t i = 0; i < m->route.n_routes; i++)
            if (m->route.routes[i].status != KM_OK)
                return false;
        return true;
    case KM_MESSAGE_LIFECYCLE:
        for (uint32_t i = 0; i < m->lifecycle.n_events; i++)
            if (m->lifecycle.events[i].status != KM_OK)
                return false;
        return true;
    case KM_MESSAGE_WORKERS:
    case KM_MESSAGE_WORKER_LIST:
        for (uint32_t i = 0; i < m->workers.n_workers; i++)
            if (m->workers.workers[i].status != KM_OK)
                return false;
        return true;
    case KM_MESSAGE_STATUS_REPLY:
        for (uint32_t i = 0; i < m->status_reply.n_workers; i++)
            if (m->status_reply.workers[i].status != KM_OK)
                return false;
        return true;
    case KM_MESSAGE_POOLS:
    case KM_MESSAGE_POOL_LIST:
        for (uint32_t i = 0; i < m->pools.n_pools; i++)
            if (m->pools.pools[i].status != KM_OK)
                return false;
        return true;
    default:
        return true;
    }
}

static void check_item_messages(const km_message *m)
{
    /* a failed item says why */
    switch (m->type) {
    case KM_MESSAGE_ROUTE:
        for (uint32_t i = 0; i < m->route.n_routes; i++)
            if (m->route.routes[i].status != KM_OK)
                CHECK(m->route.routes[i].status < 0 && m->route.routes[i].message &&
                      m->route.routes[i].message[0]);
        break;
    case KM_MESSAGE_LIFECYCLE:
        for (uint32_t i = 0; i < m->lifecycle.n_events; i++)
            if (m->lifecycle.events[i].status != KM_OK)
                CHECK(m->lifecycle.events[i].status < 0 && m->lifecycle.events[i].message &&
                      m->lifecycle.events[i].message[0]);
        break;
    default:
        break;
    }
}

static void decode_and_check(km_protocol_decoder *dec, const uint8_t *p, size_t n)
{
    km_message m;
    memset(&m, 0xA5, sizeof m);
    int rc = km_protocol_decode(dec, p, n, &m);
    const char *err = km_protocol_decoder_last_error(dec);
    CHECK(err != NULL);
    if (rc != KM_OK) {
        CHECK(rc < 0);
        CHECK(err[0] != '\0');
        return;
    }
    CHECK(err[0] == '\0');
    CHECK(m.has_id);
    check_item_messages(&m);
    if (!all_items_ok(&m))
        return;

    /* decode -> encode -> decode -> encode: the two encodings are the same bytes */
    km_frame_buffer b1, b2;
    km_frame_buffer_init(&b1);
    km_frame_buffer_init(&b2);
    char why[256] = "";
    rc = km_protocol_encode(&m, 0, &b1, why, sizeof why);
    if (rc != KM_OK) {
        fprintf(stderr, "decoded %s message does not re-encode: %s\n", km_message_type_name(m.type),
                why);
        abort();
    }
    CHECK(b1.size > KM_FRAME_HEADER_BYTES);
    km_message m2;
    rc = km_protocol_decode(dec_check, b1.data + KM_FRAME_HEADER_BYTES,
                            b1.size - KM_FRAME_HEADER_BYTES, &m2);
    if (rc != KM_OK) {
        fprintf(stderr, "re-encoded %s message does not decode: %s\n",
                km_message_type_name(m.type), km_protocol_decoder_last_error(dec_check));
        abort();
    }
    CHECK(m2.type == m.type && m2.id == m.id);
    CHECK(all_items_ok(&m2));
    rc = km_protocol_encode(&m2, 0, &b2, why, sizeof why);
    CHECK(rc == KM_OK);
    if (b1.size != b2.size || memcmp(b1.data, b2.data, b1.size) != 0) {
        fprintf(stderr, "%s message changes on a second round trip\n", km_message_type_name(m.type));
        abort();
    }
    km_frame_buffer_free(&b1);
    km_frame_buffer_free(&b2);
    km_protocol_decoder_release(dec_check);
}

/* The length prefix at p: a frame's declared payload bytes. */
static uint32_t declared_length(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void run_reader(const uint8_t *data, size_t size, uint32_t max_frame, km_protocol_decoder *dec)
{
    km_frame_reader *r = NULL;
    CHECK(km_frame_reader_create(max_frame, &r) == KM_OK);
    /* chunk sizes: 1..64, from a simple hash of the input, or the whole stream */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < size && i < 16; i++)
        h = (h ^ data[i]) * 16777619u;
    bool whole = (h & 3) == 0;
    const uint8_t *p = data;
    size_t left = size;
    size_t frame_start = 0; /* where the frame being assembled begins in the stream */
    int sticky = KM_OK;
    while (left) {
        size_t chunk = whole ? left : 1 + (h >> 8) % 64;
        h = h * 1103515245u + 12345u;
        if (chunk > left)
            chunk = left;
        size_t consumed = 0;
        const uint8_t *payload = NULL;
        size_t payload_size = 0;
        int rc = km_frame_reader_next(r, p, chunk, &consumed, &payload, &payload_size);
        if (rc != KM_OK) {
            CHECK(rc < 0);
            CHECK(km_frame_reader_failed(r));
            /* Refused for its length prefix, complete in this chunk, or out of memory. */
            if (rc != KM_ERR_OUT_OF_MEMORY) {
                CHECK((size_t)(p - data) + chunk >= frame_start + KM_FRAME_HEADER_BYTES);
                uint32_t declared = declared_length(data + frame_start);
                CHECK(rc == (declared == 0 ? KM_ERR_PROTOCOL : KM_ERR_TOO_LARGE));
                CHECK(declared == 0 || declared > max_frame);
            }
            CHECK(km_frame_reader_last_error(r)[0] != '\0');
            if (sticky != KM_OK)
                CHECK(rc == sticky);
            sticky = rc;
            /* sticky: one more call says the same */
            rc = km_frame_reader_next(r, p, chunk, &consumed, &payload, &payload_size);
            CHECK(rc == sticky);
            break;
        }
        CHECK(!km_frame_reader_failed(r));
        CHECK(consumed <= chunk);
        CHECK(consumed > 0);
        /* The reader holds exactly the bytes of the frame it is assembling: from its first byte
         * (frame_start) to what it has taken, 0 once the frame is handed out. */
        size_t taken = (size_t)(p - data) + consumed - frame_start;
        if (payload) {
            CHECK(km_frame_reader_pending(r) == 0);
            CHECK(taken == KM_FRAME_HEADER_BYTES + payload_size);
            /* the payload is the frame's own bytes */
            CHECK(declared_length(data + frame_start) == payload_size);
            CHECK(memcmp(payload, data + frame_start + KM_FRAME_HEADER_BYTES, payload_size) == 0);
            frame_start += taken;
        } else {
            CHECK(consumed == chunk); /* no frame ends in it: all of it taken */
            CHECK(km_frame_reader_pending(r) == taken);
            if (taken >= KM_FRAME_HEADER_BYTES) {
                uint32_t declared = declared_length(data + frame_start);
                CHECK(declared >= 1 && declared <= max_frame);
                CHECK(taken < KM_FRAME_HEADER_BYTES + (size_t)declared);
            }
        }
        p += consumed;
        left -= consumed;
        if (payload) {
            CHECK(payload_size >= 1 && payload_size <= max_frame);
            decode_and_check(dec, payload, payload_size);
            km_protocol_decoder_release(dec);
            km_frame_reader_release(r);
        }
    }
    km_frame_reader_destroy(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init();
    /* a private copy, so reading past the end is caught by ASan */
    uint8_t *copy = malloc(size ? size : 1);
    CHECK(copy);
    memcpy(copy, data, size);

    if (size > KM_FRAME_HEADER_BYTES) {
        /* the input as a framed stream, and the payload of its first frame as one payload */
        run_reader(copy, size, KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES, dec_default);
        run_reader(copy, size, 512, dec_tight);
        decode_and_check(dec_default, copy + KM_FRAME_HEADER_BYTES, size - KM_FRAME_HEADER_BYTES);
        decode_and_check(dec_tight, copy + KM_FRAME_HEADER_BYTES, size - KM_FRAME_HEADER_BYTES);
    }
    decode_and_check(dec_default, copy, size);
    km_protocol_decoder_release(dec_default);
    km_protocol_decoder_release(dec_tight);
    free(copy);
    return 0;
}
