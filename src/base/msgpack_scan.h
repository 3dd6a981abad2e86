/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: what the msgpack wire decoders (src/events/kv_events.c, the router protocol's decoder
 * in src/service/) share. km_msgpack_scan is their first stage: it walks untrusted bytes once,
 * without allocating, within hard limits, before msgpack-c unpacks them. msgpack-c allocates a
 * container's element array from its *declared* length before it reads an element, so without
 * this stage a 5-byte buffer could ask for gigabytes. km_msgpack_type_name names an object's type
 * in the decoders' error messages. */
#ifndef KM_MSGPACK_SCAN_H
#define KM_MSGPACK_SCAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"

/* The deepest nesting the scanner can follow: msgpack-c's unpacker stack
 * (MSGPACK_EMBED_STACK_SIZE), so that whatever the scanner accepts msgpack-c can unpack. */
#define KM_MSGPACK_SCAN_MAX_DEPTH 32u

/* A decoder's limits, and the words its error messages use for them. */
typedef struct km_msgpack_limits {
    unsigned max_depth;   /* containers open at once, 1..KM_MSGPACK_SCAN_MAX_DEPTH (more is
                           * taken as KM_MSGPACK_SCAN_MAX_DEPTH) */
    uint64_t max_objects; /* values in the buffer, map keys and values each counted, >= 1 */
    /* The caller's name for max_objects ("max_objects"), and for the one value a buffer holds,
     * as "N bytes follow <value_name>" ends ("the message map (a frame holds exactly one
     * value)"). */
    const char *max_objects_name;
    const char *value_name;
} km_msgpack_limits;

/* The first rule a buffer breaks. For each value, in the order of the buffer, the checks run in
 * the order listed; the walk stops at the first failure. */
typedef enum km_msgpack_violation {
    KM_MSGPACK_SCAN_OK = 0,
    KM_MSGPACK_SCAN_TRUNCATED,        /* KM_ERR_PARSE: the buffer ends where a value should
                                       * start */
    KM_MSGPACK_SCAN_RESERVED_BYTE,    /* KM_ERR_PARSE: `byte` 0xc1, which msgpack leaves unused */
    KM_MSGPACK_SCAN_HEADER_TRUNCATED, /* KM_ERR_PARSE: a header of `declared` bytes, `available`
                                       * left */
    KM_MSGPACK_SCAN_TOO_DEEP,         /* KM_ERR_TOO_LARGE: a container would make max_depth + 1
                                       * open at once */
    KM_MSGPACK_SCAN_CONTAINER_OVERRUN, /* KM_ERR_PARSE: an array or map declares `declared`
                                        * entries, more values than the `available` bytes after
                                        * its header could hold (each takes at least one byte) */
    KM_MSGPACK_SCAN_BODY_TRUNCATED,   /* KM_ERR_PARSE: a str, bin or ext body of `declared` bytes,
                                       * `available` left */
    KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, /* KM_ERR_TOO_LARGE: this value is number max_objects + 1 */
    KM_MSGPACK_SCAN_TRAILING_BYTES,   /* KM_ERR_PARSE: `available` bytes follow the one value */
} km_msgpack_violation;

/* What a scan found. */
typedef struct km_msgpack_scan_result {
    km_msgpack_violation violation;
    /* Success: values in the buffer (map keys included), and the bytes msgpack-c's unpacker takes
     * from its zone for them (the element arrays of every array and map). */
    uint64_t objects;
    uint64_t zone_bytes;
    /* Failure: offset is that of the offending value's first byte (TRUNCATED: the size;
     * TRAILING_BYTES: the end of the one value), depth the containers open around it; declared,
     * available, byte and is_map are set where the violation says, else 0. */
    size_t offset;
    unsigned depth;
    uint64_t declared;
    size_t available;
    unsigned char byte; /* RESERVED_BYTE */
    bool is_map;        /* CONTAINER_OVERRUN */
} km_msgpack_scan_result;

/* Walk data[0..size) and check that it is exactly one complete, well-formed msgpack value within
 * `limits`. Reads no byte outside data[0..size) and allocates nothing; O(size).
 *
 * KM_OK guarantees: msgpack_unpack on the same bytes returns MSGPACK_UNPACK_SUCCESS (unless its
 * zone cannot allocate), having read all `size` bytes, builds scan->objects objects with no
 * container nested deeper than max_depth, and allocates scan->zone_bytes bytes of element arrays.
 * Otherwise returns KM_ERR_PARSE or KM_ERR_TOO_LARGE, as km_msgpack_violation says, with
 * scan->violation and where it was; km_msgpack_scan_explain words it. */
int km_msgpack_scan(const void *data, size_t size, const km_msgpack_limits *limits,
                    km_msgpack_scan_result *scan);

/* The sentence a decoder reports for a failed scan, into buf[0..size) (cut to fit):
 * "payload truncated or corrupt: map at offset 0 declares 4294967295 entries but only 1 bytes
 * follow". "" after a success. */
void km_msgpack_scan_explain(const km_msgpack_limits *limits, const km_msgpack_scan_result *scan,
                             char *buf, size_t size);

struct msgpack_object;

/* The unsigned big-endian number in p[0..bytes), bytes <= 8: msgpack's lengths and numbers, and
 * the decoders' byte-string hashes and sequence numbers. */
static inline uint64_t km_read_be(const uint8_t *p, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes; i++)
        v = v << 8 | p[i];
    return v;
}

/* "nil", "bool", "non-negative int", "negative int", "float", "str", "array", "map", "bin",
 * "ext"; for the decoders' "expected ..., got <type>" messages. */
const char *km_msgpack_type_name(const struct msgpack_object *object);

#endif
