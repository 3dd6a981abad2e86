/* SPDX-License-Identifier: Apache-2.0 */
/* The bounded msgpack pre-scan (src/base/msgpack_scan.h): each violation with its status, fields
 * and sentence; then properties on fresh random inputs (valid values in every encoding, and those
 * values cut, corrupted and padded, and plain random bytes): the scanner's verdict equals a
 * brute-force recursive checker's, field by field, under random limits, and whatever it accepts
 * msgpack-c unpacks into exactly the objects and zone bytes it announced. Inputs sit at the end
 * of an allocation of their exact size, so a read past the end is a sanitizer report under
 * `make asan`. Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "base/msgpack_scan.h"
#include "test_util.h"

static const km_msgpack_limits wide = {
    .max_depth = KM_MSGPACK_SCAN_MAX_DEPTH,
    .max_objects = UINT64_MAX,
    .max_objects_name = "max_objects",
    .value_name = "the value",
};

/* Scan a copy of bytes[0..size) that ends where its allocation ends. */
static int scan_exact(const void *bytes, size_t size, const km_msgpack_limits *limits,
                      km_msgpack_scan_result *out)
{
    uint8_t *copy = malloc(size ? size : 1);
    cr_assert(copy);
    if (size)
        memcpy(copy, bytes, size);
    int rc = km_msgpack_scan(copy, size, limits, out);
    free(copy);
    return rc;
}

/* ---- each violation ----------------------------------------------------------------------- */

typedef struct violation_case {
    const char *bytes;
    size_t size;
    unsigned max_depth;   /* 0: KM_MSGPACK_SCAN_MAX_DEPTH */
    uint64_t max_objects; /* 0: unlimited */
    int status;
    km_msgpack_violation violation;
    size_t offset;
    unsigned depth;
    uint64_t declared;
    size_t available;
    const char *sentence;
} violation_case;

static const violation_case violation_cases[] = {
    {"", 0, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_TRUNCATED, 0, 0, 0, 0,
     "payload truncated: 0 bytes end inside a value nested 0 deep"},
    {"\x92\xa1x", 3, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_TRUNCATED, 3, 1, 0, 0,
     "payload truncated: 3 bytes end inside a value nested 1 deep"},
    {"\x91\x81\xa1k", 4, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_TRUNCATED, 4, 2, 0, 0,
     "payload truncated: 4 bytes end inside a value nested 2 deep"},
    {"\x92\x01\xc1", 3, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_RESERVED_BYTE, 2, 1, 0, 0,
     "byte 0xc1 at offset 2 is not a valid msgpack type"},
    {"\xcd\x01", 2, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_HEADER_TRUNCATED, 0, 0, 3, 2,
     "payload truncated: value header at offset 0 needs 3 bytes, 2 left"},
    {"\x91\xcb\x00\x00", 4, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_HEADER_TRUNCATED, 1, 1, 9, 3,
     "payload truncated: value header at offset 1 needs 9 bytes, 3 left"},
    {"\xc9\x00\x00\x01", 4, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_HEADER_TRUNCATED, 0, 0, 6, 4,
     "payload truncated: value header at offset 0 needs 6 bytes, 4 left"}, /* ext32 */
    {"\xdf\xff\xff\xff\xff\x01", 6, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_CONTAINER_OVERRUN, 0, 0,
     4294967295u, 1,
     "payload truncated or corrupt: map at offset 0 declares 4294967295 entries but only 1 bytes "
     "follow"},
    {"\x81\x01", 2, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_CONTAINER_OVERRUN, 0, 0, 1, 1,
     "payload truncated or corrupt: map at offset 0 declares 1 entries but only 1 bytes follow"},
    {"\x92\x01\xdc\x00\x03\x01\x02", 7, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_CONTAINER_OVERRUN, 2,
     1, 3, 2,
     "payload truncated or corrupt: array at offset 2 declares 3 entries but only 2 bytes follow"},
    {"\xa3" "ab", 3, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_BODY_TRUNCATED, 0, 0, 3, 2,
     "payload truncated: value at offset 0 needs 3 more bytes, 2 left"},
    {"\x91\xc6\x7f\xff\xff\xff\x00", 7, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_BODY_TRUNCATED, 1, 1,
     2147483647u, 1, "payload truncated: value at offset 1 needs 2147483647 more bytes, 1 left"},
    {"\xd8\x05\x00", 3, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_BODY_TRUNCATED, 0, 0, 16, 1,
     "payload truncated: value at offset 0 needs 16 more bytes, 1 left"}, /* fixext16 */
    {"\x91\x91\x91\xc0", 4, 2, 0, KM_ERR_TOO_LARGE, KM_MSGPACK_SCAN_TOO_DEEP, 2, 2, 0, 0,
     "containers nested deeper than 2 at offset 2"},
    {"\x91\x91\x90", 3, 2, 0, KM_ERR_TOO_LARGE, KM_MSGPACK_SCAN_TOO_DEEP, 2, 2, 0, 0,
     "containers nested deeper than 2 at offset 2"}, /* an empty container counts too */
    {"\x93\x01\x02\x03", 4, 0, 3, KM_ERR_TOO_LARGE, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, 3, 1, 0, 0,
     "payload holds more than max_objects = 3 msgpack values"},
    {"\x92\x01\x91\x02", 4, 0, 2, KM_ERR_TOO_LARGE, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, 2, 1, 0, 0,
     "payload holds more than max_objects = 2 msgpack values"},
    {"\x01\x02", 2, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_TRAILING_BYTES, 1, 0, 0, 1,
     "1 bytes follow the value"},
    {"\x90\x90\x90", 3, 0, 0, KM_ERR_PARSE, KM_MSGPACK_SCAN_TRAILING_BYTES, 1, 0, 0, 2,
     "2 bytes follow the value"},
    /* The checks' order within one value: structure before the count, depth before length. */
    {"\x92\x01\xa5x", 4, 0, 2, KM_ERR_PARSE, KM_MSGPACK_SCAN_BODY_TRUNCATED, 2, 1, 5, 1,
     "payload truncated: value at offset 2 needs 5 more bytes, 1 left"},
    {"\x91\xdd\xff\xff\xff\xff", 6, 1, 0, KM_ERR_TOO_LARGE, KM_MSGPACK_SCAN_TOO_DEEP, 1, 1, 0, 0,
     "containers nested deeper than 1 at offset 1"},
};

Test(msgpack_scan, each_violation_its_status_fields_and_sentence, .timeout = 30)
{
    for (size_t i = 0; i < sizeof violation_cases / sizeof violation_cases[0]; i++) {
        const violation_case *c = &violation_cases[i];
        km_msgpack_limits limits = wide;
        if (c->max_depth)
            limits.max_depth = c->max_depth;
        if (c->max_objects)
            limits.max_objects = c->max_objects;
        km_msgpack_scan_result s;
        int rc = scan_exact(c->bytes, c->size, &limits, &s);
        cr_assert_eq(rc, c->status, "case %zu: %s", i, km_error_name(rc));
        cr_assert_eq(s.violation, c->violation, "case %zu: violation %d", i, (int)s.violation);
        cr_assert_eq(s.offset, c->offset, "case %zu: offset %zu", i, s.offset);
        cr_assert_eq(s.depth, c->depth, "case %zu: depth %u", i, s.depth);
        cr_assert_eq(s.declared, c->declared, "case %zu: declared %" PRIu64, i, s.declared);
        cr_assert_eq(s.available, c->available, "case %zu: available %zu", i, s.available);
        char why[200];
        km_msgpack_scan_explain(&limits, &s, why, sizeof why);
        cr_assert_str_eq(why, c->sentence, "case %zu", i);
    }
}

Test(msgpack_scan, limits_at_their_edge_pass, .timeout = 30)
{
    km_msgpack_scan_result s;
    km_msgpack_limits limits = wide;
    limits.max_depth = 3;
    cr_assert_eq(scan_exact("\x91\x91\x91\xc0", 4, &limits, &s), KM_OK);
    cr_assert_eq(s.objects, 4);
    cr_assert_eq(s.zone_bytes, 3 * sizeof(msgpack_object));
    limits.max_depth = 1000; /* taken as KM_MSGPACK_SCAN_MAX_DEPTH */
    uint8_t deep[KM_MSGPACK_SCAN_MAX_DEPTH + 2];
    memset(deep, 0x91, sizeof deep);
    deep[KM_MSGPACK_SCAN_MAX_DEPTH] = 0xc0;
    cr_assert_eq(scan_exact(deep, KM_MSGPACK_SCAN_MAX_DEPTH + 1, &limits, &s), KM_OK);
    deep[KM_MSGPACK_SCAN_MAX_DEPTH] = 0x91;
    deep[KM_MSGPACK_SCAN_MAX_DEPTH + 1] = 0xc0;
    cr_assert_eq(scan_exact(deep, sizeof deep, &limits, &s), KM_ERR_TOO_LARGE);
    char why[100];
    km_msgpack_scan_explain(&limits, &s, why, sizeof why);
    cr_assert_str_eq(why, "containers nested deeper than 32 at offset 32");

    limits = wide;
    limits.max_objects = 5; /* the map and its two entries, each two values */
    cr_assert_eq(scan_exact("\x82\x01\x02\x03\xc0", 5, &limits, &s), KM_OK);
    cr_assert_eq(scan_exact("\x91\x82\x01\x02\x03\xc0", 6, &limits, &s), KM_ERR_TOO_LARGE);
    /* A container declaring exactly as many one-byte values as follow. */
    cr_assert_eq(scan_exact("\xdd\x00\x00\x00\x03\x01\x02\x03", 8, &wide, &s), KM_OK);
    cr_assert_eq(s.objects, 4);
    km_msgpack_scan_explain(&wide, &s, why, sizeof why);
    cr_assert_str_eq(why, "");
}

/* Only data[0..size) is read: a valid continuation behind the end changes nothing. */
Test(msgpack_scan, never_reads_past_the_size, .timeout = 30)
{
    static const uint8_t value[] = {0x93, 0x01, 0xa2, 'h', 'i', 0xcd, 0x01, 0x02};
    km_msgpack_scan_result s;
    cr_assert_eq(km_msgpack_scan(value, sizeof value, &wide, &s), KM_OK);
    for (size_t cut = 0; cut < sizeof value; cut++) {
        cr_assert_eq(scan_exact(value, cut, &wide, &s), KM_ERR_PARSE, "cut %zu", cut);
        cr_assert(s.offset <= cut, "cut %zu: offset %zu", cut, s.offset);
    }
}

/* ---- the brute-force checker ---------------------------------------------------------------- */

/* A recursive reading of the msgpack specification, written apart from the scanner: the same
 * rules in the same order, one value at a time. */
typedef struct reference {
    const uint8_t *p;
    size_t size;
    const km_msgpack_limits *limits;
    unsigned max_depth;
    uint64_t objects, zone_bytes;
    km_msgpack_scan_result failure;
} reference;

static bool ref_fail(reference *r, km_msgpack_violation v, size_t offset, unsigned depth,
                     uint64_t declared, size_t available)
{
    memset(&r->failure, 0, sizeof r->failure);
    r->failure.violation = v;
    r->failure.offset = offset;
    r->failure.depth = depth;
    r->failure.declared = declared;
    r->failure.available = available;
    return false;
}

/* The value at *pos with `depth` containers open around it; false at the first violation. */
static bool ref_value(reference *r, size_t *pos, unsigned depth)
{
    const size_t at = *pos;
    if (at >= r->size)
        return ref_fail(r, KM_MSGPACK_SCAN_TRUNCATED, r->size, depth, 0, 0);
    const uint8_t b = r->p[at];
    /* Classify: fixed-size values, bodies with a length field, containers. */
    size_t fixed = 0;       /* total size of a value without a body */
    unsigned length_of = 0; /* width of a length field */
    size_t body_fixed = 0;  /* fixext and fixstr: body size known from the type byte */
    bool has_body = false, is_map = false, is_ext = false;
    uint64_t entries = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        fixed = 1;
    else if (b == 0xc1) {
        ref_fail(r, KM_MSGPACK_SCAN_RESERVED_BYTE, at, depth, 0, 0);
        r->failure.byte = b;
        return false;
    }
    else if (b >= 0x80 && b <= 0x8f)
        is_map = true, entries = b & 15;
    else if (b >= 0x90 && b <= 0x9f)
        entries = b & 15;
    else if (b >= 0xa0 && b <= 0xbf)
        has_body = true, body_fixed = b & 31;
    else if (b == 0xcc || b == 0xd0)
        fixed = 2;
    else if (b == 0xcd || b == 0xd1)
        fixed = 3;
    else if (b == 0xca || b == 0xce || b == 0xd2)
        fixed = 5;
    else if (b == 0xcb || b == 0xcf || b == 0xd3)
        fixed = 9;
    else if (b >= 0xd4 && b <= 0xd8)
        has_body = is_ext = true, body_fixed = (size_t)1 << (b - 0xd4);
    else if (b == 0xc4 || b == 0xd9 || b == 0xc7)
        has_body = true, length_of = 1, is_ext = b == 0xc7;
    else if (b == 0xc5 || b == 0xda || b == 0xc8)
        has_body = true, length_of = 2, is_ext = b == 0xc8;
    else if (b == 0xc6 || b == 0xdb || b == 0xc9)
        has_body = true, length_of = 4, is_ext = b == 0xc9;
    else if (b == 0xdc || b == 0xdd)
        length_of = b == 0xdc ? 2 : 4;
    else if (b == 0xde || b == 0xdf)
        is_map = true, length_of = b == 0xde ? 2 : 4;
    else
        cr_assert_fail("byte 0x%02x unclassified", b);
    size_t left = r->size - at;
    if (fixed) {
        if (left < fixed)
            return ref_fail(r, KM_MSGPACK_SCAN_HEADER_TRUNCATED, at, depth, fixed, left);
        *pos = at + fixed;
    } else {
        size_t header = 1 + length_of + (is_ext ? 1 : 0);
        if (left < header)
            return ref_fail(r, KM_MSGPACK_SCAN_HEADER_TRUNCATED, at, depth, header, left);
        uint64_t length = 0;
        for (unsigned i = 0; i < length_of; i++)
            length = length * 256 + r->p[at + 1 + i];
        size_t after = left - header;
        if (has_body) {
            uint64_t body = length_of ? length : body_fixed;
            if (body > after)
                return ref_fail(r, KM_MSGPACK_SCAN_BODY_TRUNCATED, at, depth, body, after);
            *pos = at + header + body;
        } else {
            if (length_of)
                entries = length;
            if (depth + 1 > r->max_depth)
                return ref_fail(r, KM_MSGPACK_SCAN_TOO_DEEP, at, depth, 0, 0);
            uint64_t values = is_map ? 2 * entries : entries;
            if (values > after) {
                ref_fail(r, KM_MSGPACK_SCAN_CONTAINER_OVERRUN, at, depth, entries, after);
                r->failure.is_map = is_map;
                return false;
            }
            if (++r->objects > r->limits->max_objects)
                return ref_fail(r, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, at, depth, 0, 0);
            r->zone_bytes += entries * (is_map ? sizeof(msgpack_object_kv) : sizeof(msgpack_object));
            *pos = at + header;
            for (uint64_t i = 0; i < values; i++)
                if (!ref_value(r, pos, depth + 1))
                    return false;
            return true;
        }
    }
    if (++r->objects > r->limits->max_objects)
        return ref_fail(r, KM_MSGPACK_SCAN_TOO_MANY_OBJECTS, at, depth, 0, 0);
    return true;
}

static int ref_scan(const uint8_t *p, size_t size, const km_msgpack_limits *limits,
                    km_msgpack_scan_result *out)
{
    reference r = {.p = p, .size = size, .limits = limits};
    r.max_depth = limits->max_depth < KM_MSGPACK_SCAN_MAX_DEPTH ? limits->max_depth
                                                                : KM_MSGPACK_SCAN_MAX_DEPTH;
    size_t pos = 0;
    bool ok = ref_value(&r, &pos, 0);
    if (ok && pos != size)
        ok = ref_fail(&r, KM_MSGPACK_SCAN_TRAILING_BYTES, pos, 0, 0, size - pos);
    if (ok) {
        memset(out, 0, sizeof *out);
        out->objects = r.objects;
        out->zone_bytes = r.zone_bytes;
        return KM_OK;
    }
    *out = r.failure;
    return r.failure.violation == KM_MSGPACK_SCAN_TOO_DEEP ||
                   r.failure.violation == KM_MSGPACK_SCAN_TOO_MANY_OBJECTS
               ? KM_ERR_TOO_LARGE
               : KM_ERR_PARSE;
}

/* ---- random inputs ---------------------------------------------------------------------------- */

typedef struct bytes {
    uint8_t *data;
    size_t size, capacity;
} bytes;

static void put(bytes *b, const void *p, size_t n)
{
    if (b->size + n > b->capacity) {
        b->capacity = (b->size + n) * 2 + 64;
        b->data = realloc(b->data, b->capacity);
        cr_assert(b->data);
    }
    memcpy(b->data + b->size, p, n);
    b->size += n;
}

static void put_byte(bytes *b, uint8_t v)
{
    put(b, &v, 1);
}

static void put_be(bytes *b, uint64_t v, unsigned width)
{
    for (unsigned i = width; i-- > 0;)
        put_byte(b, (uint8_t)(v >> (8 * i)));
}

static void put_random(bytes *b, km_rng *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        put_byte(b, (uint8_t)km_rng_next(r));
}

/* A length header: the compact form when it fits and the coin says so, else 8/16/32-bit. */
static void put_length(bytes *b, km_rng *r, uint64_t n, uint8_t fix_base, uint64_t fix_max,
                       const uint8_t wide_types[3])
{
    unsigned choice = km_rng_below(r, 4);
    if (choice == 0 && fix_base && n <= fix_max) {
        put_byte(b, (uint8_t)(fix_base | n));
    } else if (choice <= 1 && wide_types[0] && n <= 0xff) {
        put_byte(b, wide_types[0]);
        put_be(b, n, 1);
    } else if (choice <= 2 && n <= 0xffff) {
        put_byte(b, wide_types[1]);
        put_be(b, n, 2);
    } else {
        put_byte(b, wide_types[2]);
        put_be(b, n, 4);
    }
}

/* Short lengths mostly, sometimes past 255 or 65535. */
static uint32_t random_length(km_rng *r)
{
    switch (km_rng_below(r, 10)) {
    case 0: return 256 + km_rng_below(r, 300);
    case 1: return km_rng_percent(r, 10) ? 65536 + km_rng_below(r, 10) : 40;
    default: return km_rng_below(r, 33);
    }
}

/* One valid value, nested at most `depth` more levels, every encoding msgpack allows (non-minimal
 * lengths included: msgpack-c takes them). */
static void gen_value(bytes *b, km_rng *r, unsigned depth)
{
    static const uint8_t str_types[3] = {0xd9, 0xda, 0xdb};
    static const uint8_t bin_types[3] = {0xc4, 0xc5, 0xc6};
    static const uint8_t ext_types[3] = {0xc7, 0xc8, 0xc9};
    static const uint8_t array_types[3] = {0, 0xdc, 0xdd};
    static const uint8_t map_types[3] = {0, 0xde, 0xdf};
    unsigned kind = km_rng_below(r, depth ? 14 : 10);
    switch (kind) {
    case 0: put_byte(b, (uint8_t)km_rng_below(r, 128)); break;           /* positive fixint */
    case 1: put_byte(b, (uint8_t)(0xe0 | km_rng_below(r, 32))); break;  /* negative fixint */
    case 2: put_byte(b, (const uint8_t[]){0xc0, 0xc2, 0xc3}[km_rng_below(r, 3)]); break; /* nil, bool */
    case 3: { /* u8..u64, i8..i64, float 32/64 */
        static const uint8_t types[] = {0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3, 0xca, 0xcb};
        static const unsigned widths[] = {1, 2, 4, 8, 1, 2, 4, 8, 4, 8};
        unsigned t = km_rng_below(r, 10);
        put_byte(b, types[t]);
        put_random(b, r, widths[t]);
        break;
    }
    case 4:
    case 5: { /* str */
        uint32_t n = random_length(r);
        put_length(b, r, n, 0xa0, 31, str_types);
        put_random(b, r, n);
        break;
    }
    case 6: { /* bin */
        uint32_t n = random_length(r);
        put_length(b, r, n, 0, 0, bin_types);
        put_random(b, r, n);
        break;
    }
    case 7: { /* fixext */
        unsigned t = km_rng_below(r, 5);
        put_byte(b, (uint8_t)(0xd4 + t));
        put_random(b, r, 1 + ((size_t)1 << t));
        break;
    }
    case 8: { /* ext 8/16/32: length, type byte, data */
        uint32_t n = random_length(r);
        put_length(b, r, n, 0, 0, ext_types);
        put_random(b, r, 1 + n);
        break;
    }
    case 9: put_byte(b, km_rng_percent(r, 50) ? 0x90 : 0x80); break; /* empty containers */
    default: { /* array or map of up to 6 entries */
        bool is_map = km_rng_percent(r, 40);
        uint32_t n = km_rng_below(r, 7);
        put_length(b, r, n, is_map ? 0x80 : 0x90, 15, is_map ? map_types : array_types);
        for (uint32_t i = 0; i < (is_map ? 2 * n : n); i++)
            gen_value(b, r, depth - 1);
        break;
    }
    }
}

/* A chain of `levels` one-element arrays (and maps) around a value: depths near the limits. */
static void gen_deep(bytes *b, km_rng *r, unsigned levels)
{
    for (unsigned i = 0; i < levels; i++) {
        if (km_rng_percent(r, 20)) {
            put_byte(b, 0x81);
            gen_value(b, r, 0);
        } else {
            put_byte(b, 0x91);
        }
    }
    gen_value(b, r, 2);
}

/* One random input: valid, a valid value damaged, or noise. */
static void gen_input(bytes *b, km_rng *r)
{
    b->size = 0;
    unsigned shape = km_rng_below(r, 10);
    if (shape == 0) {
        put_random(b, r, km_rng_below(r, 24));
        return;
    }
    if (shape == 1)
        gen_deep(b, r, 26 + km_rng_below(r, 12));
    else
        gen_value(b, r, 1 + km_rng_below(r, 4));
    switch (km_rng_below(r, 8)) {
    case 0: /* cut */
        b->size = km_rng_below(r, (uint32_t)b->size + 1);
        break;
    case 1: /* a byte changed */
        b->data[km_rng_below(r, (uint32_t)b->size)] = (uint8_t)km_rng_next(r);
        break;
    case 2: /* a byte changed to one that often starts or sizes something */
        b->data[km_rng_below(r, (uint32_t)b->size)] =
            (const uint8_t[]){0xc1, 0xff, 0xdd, 0xdf, 0x9f, 0x8f, 0xdb, 0x00}[km_rng_below(r, 8)];
        break;
    case 3: /* trailing bytes */
        put_random(b, r, 1 + km_rng_below(r, 3));
        break;
    default: /* left valid */
        break;
    }
}

static void expect_same(const km_msgpack_scan_result *got, int rc, const km_msgpack_scan_result *want,
                        int want_rc, const bytes *b, unsigned iteration)
{
    KM_CHECK(rc == want_rc && got->violation == want->violation,
             "input %u (%zu bytes): scanner %s / violation %d, reference %s / %d", iteration,
             b->size, km_error_name(rc), (int)got->violation, km_error_name(want_rc),
             (int)want->violation);
    if (rc == KM_OK) {
        KM_CHECK(got->objects == want->objects && got->zone_bytes == want->zone_bytes,
                 "input %u: objects %" PRIu64 " / %" PRIu64 ", zone bytes %" PRIu64 " / %" PRIu64,
                 iteration, got->objects, want->objects, got->zone_bytes, want->zone_bytes);
        return;
    }
    KM_CHECK(got->offset == want->offset && got->depth == want->depth &&
                 got->declared == want->declared && got->available == want->available &&
                 got->byte == want->byte && got->is_map == want->is_map,
             "input %u, violation %d: offset %zu / %zu, depth %u / %u, declared %" PRIu64
             " / %" PRIu64 ", available %zu / %zu",
             iteration, (int)got->violation, got->offset, want->offset, got->depth, want->depth,
             got->declared, want->declared, got->available, want->available);
}

Test(msgpack_scan, matches_the_brute_force_checker_on_random_inputs, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    bytes b = {0};
    unsigned seen[KM_MSGPACK_SCAN_TRAILING_BYTES + 1] = {0};
    for (unsigned it = 0; it < 40000; it++) {
        gen_input(&b, &r);
        km_msgpack_limits limits = wide;
        if (km_rng_percent(&r, 50)) {
            limits.max_depth = 1 + km_rng_below(&r, 40);
            limits.max_objects = 1 + km_rng_below(&r, 120);
        }
        km_msgpack_scan_result got, want;
        int rc = scan_exact(b.data, b.size, &limits, &got);
        int want_rc = ref_scan(b.data, b.size, &limits, &want);
        expect_same(&got, rc, &want, want_rc, &b, it);
        seen[got.violation]++;
    }
    /* The generator reaches every outcome, so the comparison covers each. */
    for (unsigned v = 0; v <= KM_MSGPACK_SCAN_TRAILING_BYTES; v++)
        KM_CHECK(seen[v] > 0, "violation %u never produced", v);
    free(b.data);
}

/* Count the objects of a tree, its container bytes, and its depth. */
static void tree_shape(const msgpack_object *o, unsigned depth, uint64_t *objects,
                       uint64_t *zone_bytes, unsigned *max_depth)
{
    ++*objects;
    if (o->type == MSGPACK_OBJECT_ARRAY) {
        if (depth + 1 > *max_depth)
            *max_depth = depth + 1;
        *zone_bytes += o->via.array.size * sizeof(msgpack_object);
        for (uint32_t i = 0; i < o->via.array.size; i++)
            tree_shape(&o->via.array.ptr[i], depth + 1, objects, zone_bytes, max_depth);
    } else if (o->type == MSGPACK_OBJECT_MAP) {
        if (depth + 1 > *max_depth)
            *max_depth = depth + 1;
        *zone_bytes += o->via.map.size * sizeof(msgpack_object_kv);
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            tree_shape(&o->via.map.ptr[i].key, depth + 1, objects, zone_bytes, max_depth);
            tree_shape(&o->via.map.ptr[i].val, depth + 1, objects, zone_bytes, max_depth);
        }
    }
}

/* The contract with msgpack-c: accepted bytes unpack, whole, into the announced objects and zone
 * bytes within the limits; bytes refused for anything but an overrun declaration (which would
 * make msgpack-c allocate the declared size) are refused by msgpack-c too. */
Test(msgpack_scan, agrees_with_msgpack_c_on_random_inputs, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    bytes b = {0};
    unsigned accepted = 0;
    for (unsigned it = 0; it < 20000; it++) {
        gen_input(&b, &r);
        km_msgpack_limits limits = wide;
        if (km_rng_percent(&r, 30))
            limits.max_depth = 1 + km_rng_below(&r, KM_MSGPACK_SCAN_MAX_DEPTH);
        km_msgpack_scan_result s;
        int rc = scan_exact(b.data, b.size, &limits, &s);
        if (s.violation == KM_MSGPACK_SCAN_CONTAINER_OVERRUN)
            continue;
        if (s.violation == KM_MSGPACK_SCAN_TOO_DEEP && limits.max_depth < KM_MSGPACK_SCAN_MAX_DEPTH)
            continue; /* deeper than this caller allows, not than msgpack-c does */
        msgpack_zone zone;
        cr_assert(msgpack_zone_init(&zone, 4096));
        msgpack_object root;
        size_t offset = 0;
        msgpack_unpack_return ur =
            msgpack_unpack((const char *)b.data, b.size, &offset, &zone, &root);
        if (rc == KM_OK) {
            accepted++;
            KM_CHECK(ur == MSGPACK_UNPACK_SUCCESS && offset == b.size,
                     "input %u: accepted, msgpack-c returned %d at %zu of %zu", it, (int)ur, offset,
                     b.size);
            uint64_t objects = 0, zone_bytes = 0;
            unsigned depth = 0;
            tree_shape(&root, 0, &objects, &zone_bytes, &depth);
            KM_CHECK(objects == s.objects && zone_bytes == s.zone_bytes &&
                         depth <= limits.max_depth,
                     "input %u: tree of %" PRIu64 " objects, %" PRIu64 " zone bytes, depth %u; "
                     "scan said %" PRIu64 ", %" PRIu64,
                     it, objects, zone_bytes, depth, s.objects, s.zone_bytes);
        } else {
            KM_CHECK(ur != MSGPACK_UNPACK_SUCCESS,
                     "input %u (%zu bytes): refused (violation %d), msgpack-c unpacked it", it,
                     b.size, (int)s.violation);
        }
        msgpack_zone_destroy(&zone);
    }
    KM_CHECK(accepted > 5000, "only %u of 20000 inputs valid", accepted);
    free(b.data);
}

/* Every proper prefix of a valid value is refused as KM_ERR_PARSE, at or before its end. */
Test(msgpack_scan, every_prefix_of_a_valid_value_is_refused, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    bytes b = {0};
    for (unsigned it = 0; it < 300; it++) {
        b.size = 0;
        gen_value(&b, &r, 3);
        km_msgpack_scan_result s;
        KM_CHECK(scan_exact(b.data, b.size, &wide, &s) == KM_OK, "value %u refused", it);
        for (size_t cut = 0; cut < b.size; cut++) {
            int rc = scan_exact(b.data, cut, &wide, &s);
            KM_CHECK(rc == KM_ERR_PARSE && s.offset <= cut,
                     "value %u cut at %zu of %zu: %s, violation %d at %zu", it, cut, b.size,
                     km_error_name(rc), (int)s.violation, s.offset);
        }
    }
    free(b.data);
}

/* ---- the other helpers ------------------------------------------------------------------------ */

Test(msgpack_scan, type_names_and_big_endian_reads, .timeout = 30)
{
    static const struct {
        msgpack_object_type type;
        const char *name;
    } names[] = {
        {MSGPACK_OBJECT_NIL, "nil"},
        {MSGPACK_OBJECT_BOOLEAN, "bool"},
        {MSGPACK_OBJECT_POSITIVE_INTEGER, "non-negative int"},
        {MSGPACK_OBJECT_NEGATIVE_INTEGER, "negative int"},
        {MSGPACK_OBJECT_FLOAT32, "float"},
        {MSGPACK_OBJECT_FLOAT64, "float"},
        {MSGPACK_OBJECT_STR, "str"},
        {MSGPACK_OBJECT_ARRAY, "array"},
        {MSGPACK_OBJECT_MAP, "map"},
        {MSGPACK_OBJECT_BIN, "bin"},
        {MSGPACK_OBJECT_EXT, "ext"},
        {(msgpack_object_type)99, "unknown msgpack type"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        msgpack_object o = {.type = names[i].type};
        cr_assert_str_eq(km_msgpack_type_name(&o), names[i].name);
    }
    static const uint8_t be[8] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
    cr_assert_eq(km_read_be(be, 8), 0x0123456789abcdefull);
    cr_assert_eq(km_read_be(be + 6, 2), 0xcdef);
    cr_assert_eq(km_read_be(be, 0), 0);
}
