/* SPDX-License-Identifier: Apache-2.0 */
/* The bounded msgpack pre-scan and the type names of src/base/msgpack_scan.h. The scan is on the
 * path of every frame and event payload, so its loop takes the common values (one-byte values,
 * short strings, fixed-width numbers: hashes, token ids, costs) before the general header
 * decoder, and keeps the innermost container's count in a register. */
#include "base/msgpack_scan.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <msgpack.h>
#include <msgpack/unpack_define.h> /* MSGPACK_EMBED_STACK_SIZE */

_Static_assert(KM_MSGPACK_SCAN_MAX_DEPTH <= MSGPACK_EMBED_STACK_SIZE,
               "the scanner must not accept a nesting msgpack-c cannot unpack");

/* One value header: its length, the bytes of body after it (str/bin/ext), and for containers the
 * declared entries (pairs for maps). */
typedef struct value_header {
    unsigned header_bytes;
    uint64_t body_bytes;
    bool is_container;
    bool is_map;
    uint64_t entries;
} value_header;

/* The header at p[0..available), available >= 1. Returns 0, -1 when the header does not fit
 * (h->header_bytes says how long it is), -2 for the reserved byte 0xc1. */
static int read_value_header(const uint8_t *p, size_t available, value_header *h)
{
    memset(h, 0, sizeof *h);
    uint8_t b = p[0];
    unsigned len_bytes = 0; /* width of the length field of str/bin/ext/array/map 8, 16, 32 */
    h->header_bytes = 1;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return 0; /* fixint, nil, bool */
    if (b >= 0x80 && b <= 0x9f) {
        h->is_container = true;
        h->is_map = b <= 0x8f;
        h->entries = b & 0x0fu;
        return 0;
    }
    if (b >= 0xa0 && b <= 0xbf) {
        h->body_bytes = b & 0x1fu;
        return 0;
    }
    /* clang-format off */
    switch (b) {
    case 0xcc: case 0xd0: h->header_bytes = 2; break;
    case 0xcd: case 0xd1: h->header_bytes = 3; break;
    case 0xca: case 0xce: case 0xd2: h->header_bytes = 5; break;
    case 0xcb: case 0xcf: case 0xd3: h->header_bytes = 9; break;
    case 0xd4: h->header_bytes = 2; h->body_bytes = 1; break; /* fixext: type byte + data */
    case 0xd5: h->header_bytes = 2; h->body_bytes = 2; break;
    case 0xd6: h->header_bytes = 2; h->body_bytes = 4; break;
    case 0xd7: h->header_bytes = 2; h->body_bytes = 8; break;
    case 0xd8: h->header_bytes = 2; h->body_bytes = 16; break;
    case 0xc4: case 0xd9: len_bytes = 1; break; /* bin 8, str 8 */
    case 0xc5: case 0xda: len_bytes = 2; break;
    case 0xc6: case 0xdb: len_bytes = 4; break;
    case 0xc7: len_bytes = 1; break; /* ext 8/16/32: the length, then a type byte */
    case 0xc8: len_bytes = 2; break;
    case 0xc9: len_bytes = 4; break;
    case 0xdc: len_bytes = 2; h->is_container = true; break;
    case 0xdd: len_bytes = 4; h->is_container = true; break;
    case 0xde: len_bytes = 2; h->is_container = h->is_map = true; break;
    case 0xdf: len_bytes = 4; h->is_container = h->is_map = true; break;
    default: return -2; /* 0xc1, the only byte left */
    }
    /* clang-format on */
    if (len_bytes) {
        bool is_ext = b >= 0xc7 && b <= 0xc9;
        h->header_bytes = 1 + len_bytes + (is_ext ? 1u : 0u);
        if (available < h->header_bytes)
            return -1;
        uint64_t length = km_read_be(p + 1, len_bytes);
        if (h->is_container)
            h->entries = length;
        else
            h->body_bytes = length;
        return 0;
    }
    return available < h->header_bytes ? -1 : 0;
}

static int scan_fail(km_msgpack_scan_result *scan, km_msgpack_violation violation, size_t offset,
                     uint64_t declared, size_t available, unsigned depth)
{
    scan->violation = violation;
    scan->offset = offset;
    scan->declared = declared;
    scan->available = available;
    scan->depth = depth;
    return violation == KM_MSGPACK_SCAN_TOO_DEEP || violation == KM_MSGPACK_SCAN_TOO_MANY_OBJECTS
               ? KM_ERR_TOO_LARGE
               : KM_ERR_PARSE;
}

static unsigned effective_depth(const km_msgpack_limits *limits)
{
    return limits->max_depth < KM_MSGPACK_SCAN_MAX_DEPTH ? limits->max_depth
                                                         : KM_MSGPACK_SCAN_MAX_DEPTH;
}

/* Bytes of a value that is a fixed-width scalar, by its first byte (fixint, nil, bool, the
 * numbers of 8 to 64 bits: hashes, token ids and costs are these); 0 for every other value. */
#define SIXTEEN(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x
static const uint8_t scalar_bytes[256] = {
    SIXTEEN(1), SIXTEEN(1), SIXTEEN(1), SIXTEEN(1), /* 0x00 .. 0x3f positive fixint */
    SIXTEEN(1), SIXTEEN(1), SIXTEEN(1), SIXTEEN(1), /* 0x40 .. 0x7f */
    SIXTEEN(0), SIXTEEN(0), SIXTEEN(0), SIXTEEN(0), /* 0x80 .. 0xbf fixmap, fixarray, fixstr */
    1, 0, 1, 1,                                     /* 0xc0 nil, 0xc1 reserved, 0xc2, 0xc3 bool */
    0, 0, 0, 0, 0, 0,                               /* 0xc4 .. 0xc9 bin, ext */
    5, 9,                                           /* 0xca float 32, 0xcb float 64 */
    2, 3, 5, 9, 2, 3, 5, 9,                         /* 0xcc .. 0xd3 uint, int 8 .. 64 */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,             /* 0xd4 .. 0xdf fixext, str, array, map */
    SIXTEEN(1), SIXTEEN(1),                         /* 0xe0 .. 0xff negative fixint */
};
#undef SIXTEEN

int km_msgpack_scan(const void *data, size_t size, const km_msgpack_limits *limits,
                    km_msgpack_scan_result *scan)
{
    /* Values still to come in the open containers: the innermost count in `remaining` (the
     * buffer itself is a container of one value), the enclosing ones in `pending`. */
    uint64_t pending[KM_MSGPACK_SCAN_MAX_DEPTH];
    unsigned depth = 0;
    uint64_t remaining = 1;
    const uint8_t *p = data;
    size_t pos = 0;
    uint64_t objects = 0, zone_bytes = 0;
    const uint64_t max_objects = limits->max_objects;
    const unsigned max_depth = effective_depth(limits);
    memset(scan, 0, sizeof *scan);
    for (;;) {
        const size_t start = pos; /* of the value being read */
        if (start >= size)
            return scan_fail(scan, KM_MSGPACK_SCAN_TRUNCATED, size, 0, 0, depth);
        uint8_t b = p[pos];
        size_t left = size - pos;
        unsigned scalar = scalar_bytes[b];
        if (scalar) {
            if (left < scalar)
                return scan_fail(scan, KM_MSGPACK_SCAN_HEADER_TRUNCATED, start, scalar, left,
                                 depth);
            pos += scalar;
        } else if ((b & 0xe0) == 0xa0) { /* fixstr */
            size_t body = b & 0x1fu;
            if (body > left - 1)
                return scan_fail(scan, KM_MSGPACK_SCAN_BODY_TRUNCATED, start, body, left - 1,
                                 depth);
            pos += 1 + body;
        } else {
            value_header h;
            int rc = read_value_header(p + pos, left, &h);
            if (rc == -2) {
                scan->byte = b;
                return scan_fail(scan, KM_MSGPACK_SCAN_RESERVED_BYTE, start, 0, 0, depth);
            }
            if (rc == -1)
                return scan_fail(scan, KM_MSGPACK_SCAN_HEADER_TRUNCATED, start, h.header_bytes,
                                 left, depth);
            pos += h.header_bytes;
            left = size - pos;
            if (h.is_container) {
                uint64_t values = h.is_map ? 2 * h.entries : h.entries;
                if (depth >= max_depth)
                    return scan_fail(scan, KM_MSGPACK_SCAN_TOO_DEEP, start, 0, 0, depth);
                if (values > left) {
                    scan->is_map = h.is_map;
                    return scan_fail(scan, KM_MSGPACK_SCAN_CONTAINER_OVERRUN, start, h.entries,
                                     left, depth);
                }
                zone_bytes +=
                    h.entries * (h.is_map ? sizeof(msgpack_object_kv) : sizeof(msgpack_object));
                if (values > 0) {
                    if (++objects > max_objects)
                        return scan_fail(scan, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, start, 0, 0,
                                         depth);
                    pending[depth++] = remaining;
                    remaining = values;
                    continue;
                }
            } else {
                if (h.body_bytes > left)
                    return scan_fail(scan, KM_MSGPACK_SCAN_BODY_TRUNCATED, start, h.body_bytes,
                                     left, depth);
                pos += (size_t)h.body_bytes;
            }
        }
        if (++objects > max_objects)
            return scan_fail(scan, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, start, 0, 0, depth);
        /* One value of the innermost container is complete; so may be the containers. */
        while (--remaining == 0) {
            if (depth == 0) {
                if (pos != size)
                    return scan_fail(scan, KM_MSGPACK_SCAN_TRAILING_BYTES, pos, 0, size - pos, 0);
                scan->objects = objects;
                scan->zone_bytes = zone_bytes;
                return KM_OK;
            }
            remaining = pending[--depth];
        }
    }
}

void km_msgpack_scan_explain(const km_msgpack_limits *limits, const km_msgpack_scan_result *s, char *buf,
                             size_t size)
{
    if (!buf || !size)
        return;
    switch (s->violation) {
    case KM_MSGPACK_SCAN_OK:
        buf[0] = 0;
        return;
    case KM_MSGPACK_SCAN_TRUNCATED:
        snprintf(buf, size, "payload truncated: %zu bytes end inside a value nested %u deep",
                 s->offset, s->depth);
        return;
    case KM_MSGPACK_SCAN_RESERVED_BYTE:
        snprintf(buf, size, "byte 0x%02x at offset %zu is not a valid msgpack type", s->byte,
                 s->offset);
        return;
    case KM_MSGPACK_SCAN_HEADER_TRUNCATED:
        snprintf(buf, size,
                 "payload truncated: value header at offset %zu needs %" PRIu64 " bytes, %zu left",
                 s->offset, s->declared, s->available);
        return;
    case KM_MSGPACK_SCAN_TOO_DEEP:
        snprintf(buf, size, "containers nested deeper than %u at offset %zu",
                 effective_depth(limits), s->offset);
        return;
    case KM_MSGPACK_SCAN_CONTAINER_OVERRUN:
        snprintf(buf, size,
                 "payload truncated or corrupt: %s at offset %zu declares %" PRIu64
                 " entries but only %zu bytes follow",
                 s->is_map ? "map" : "array", s->offset, s->declared, s->available);
        return;
    case KM_MSGPACK_SCAN_BODY_TRUNCATED:
        snprintf(buf, size,
                 "payload truncated: value at offset %zu needs %" PRIu64 " more bytes, %zu left",
                 s->offset, s->declared, s->available);
        return;
    case KM_MSGPACK_SCAN_TOO_MANY_OBJECTS:
        snprintf(buf, size, "payload holds more than %s = %" PRIu64 " msgpack values",
                 limits->max_objects_name, limits->max_objects);
        return;
    case KM_MSGPACK_SCAN_TRAILING_BYTES:
        snprintf(buf, size, "%zu bytes follow %s", s->available, limits->value_name);
        return;
    }
    snprintf(buf, size, "msgpack scan violation %d", (int)s->violation);
}

const char *km_msgpack_type_name(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "non-negative int";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative int";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "float";
    case MSGPACK_OBJECT_STR: return "str";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    case MSGPACK_OBJECT_BIN: return "bin";
    case MSGPACK_OBJECT_EXT: return "ext";
    }
    return "unknown msgpack type";
}
