/* SPDX-License-Identifier: Apache-2.0 */
/* The KV-event wire decoder (include/kvmatch/kv_events.h) against payloads built here with
 * msgpack-c's packer, covering every shape the publishers send (positional and map events,
 * omitted trailing defaults, unknown fields and types, int / negative / bytes hashes, both replay
 * forms), every malformation we can name (each prefix of valid payloads, a wrong type in every
 * field, lying lengths, limits, framing), random and mutated payloads, and fixtures encoded by
 * msgspec with vLLM's own struct definitions (scripts/gen-kv-event-fixtures.py).
 *
 * Out-of-bounds reads: every payload is decoded from a copy placed flush against a PROT_NONE page
 * (guarded_copy), so reading one byte past the end faults even without sanitizers; `make asan`
 * adds AddressSanitizer and UBSan on top. Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <msgpack.h>

#include "kvmatch/kv_events.h"
#include "events/kv_events_internal.h"
#include "test_util.h"

#define FIXTURE_DIR "tests/kv_events_vectors"

/* ---- guarded buffers --------------------------------------------------------------------------- */

/* One mapping per test process, grown on demand; data is copied so that it ends exactly where a
 * PROT_NONE page begins. */
static unsigned char *guard_map;
static size_t guard_data_bytes; /* readable bytes before the guard page */

static const unsigned char *guarded_copy(const void *src, size_t n)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (!guard_map || guard_data_bytes < n) {
        if (guard_map)
            munmap(guard_map, guard_data_bytes + page);
        guard_data_bytes = (n + page - 1) / page * page;
        if (guard_data_bytes == 0)
            guard_data_bytes = page;
        guard_map = mmap(NULL, guard_data_bytes + page, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        cr_assert(guard_map != MAP_FAILED, "mmap failed");
        cr_assert_eq(mprotect(guard_map + guard_data_bytes, page, PROT_NONE), 0);
    }
    unsigned char *dst = guard_map + guard_data_bytes - n;
    if (n)
        memcpy(dst, src, n);
    return dst;
}

/* ---- packing helpers --------------------------------------------------------------------------- */

typedef struct pk_buf {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} pk_buf;

static msgpack_packer *pk_begin(pk_buf *b)
{
    msgpack_sbuffer_init(&b->sb);
    msgpack_packer_init(&b->pk, &b->sb, msgpack_sbuffer_write);
    return &b->pk;
}

static void pk_end(pk_buf *b)
{
    msgpack_sbuffer_destroy(&b->sb);
}

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

static void pack_opt_cstr(msgpack_packer *pk, const char *s)
{
    if (s)
        pack_cstr(pk, s);
    else
        msgpack_pack_nil(pk);
}

static void pack_u64s(msgpack_packer *pk, const uint64_t *v, uint32_t n)
{
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(pk, v[i]);
}

static void pack_u32s(msgpack_packer *pk, const uint32_t *v, uint32_t n)
{
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint32(pk, v[i]);
}

/* Values that are wrong for some field. */
typedef enum bad_value {
    BAD_NIL,
    BAD_TRUE,
    BAD_STR,
    BAD_FLOAT,
    BAD_MAP,
    BAD_EMPTY_ARRAY,
    BAD_UINT,
    BAD_NEG,
    BAD_U32_OVER, /* 2^32 */
    BAD_U64_MAX,  /* 2^64 - 1 */
    BAD_BIN3,
    BAD_BIN0,
    BAD_BIN65,
    BAD_EXT,
    BAD_ARRAY_OF_STR,
    BAD_ARRAY_OF_FLOAT,
    BAD_ARRAY_OF_NIL,
    BAD_ARRAY_OF_NEG,
    BAD_ARRAY_OF_U32_OVER,
    BAD_ARRAY_OF_BIN0,
    BAD_ARRAY_OF_BIN65,
    BAD_ARRAY_OF_MAP,
} bad_value;

static const char *const bad_value_names[] = {
    "nil",   "true",       "str",    "float",  "map",     "[]",    "uint",  "negative",
    "2^32",  "2^64-1",     "bin3",   "bin0",   "bin65",   "ext",   "[str]", "[float]",
    "[nil]", "[negative]", "[2^32]", "[bin0]", "[bin65]", "[map]",
};

static void pack_bad(msgpack_packer *pk, bad_value v)
{
    static const unsigned char zeros[65];
    switch (v) {
    case BAD_NIL: msgpack_pack_nil(pk); break;
    case BAD_TRUE: msgpack_pack_true(pk); break;
    case BAD_STR: pack_cstr(pk, "x"); break;
    case BAD_FLOAT: msgpack_pack_double(pk, 1.5); break;
    case BAD_MAP:
        msgpack_pack_map(pk, 1);
        pack_cstr(pk, "k");
        msgpack_pack_uint8(pk, 1);
        break;
    case BAD_EMPTY_ARRAY: msgpack_pack_array(pk, 0); break;
    case BAD_UINT: msgpack_pack_uint8(pk, 7); break;
    case BAD_NEG: msgpack_pack_int8(pk, -1); break;
    case BAD_U32_OVER: msgpack_pack_uint64(pk, (uint64_t)1 << 32); break;
    case BAD_U64_MAX: msgpack_pack_uint64(pk, UINT64_MAX); break;
    case BAD_BIN3: msgpack_pack_bin_with_body(pk, zeros, 3); break;
    case BAD_BIN0: msgpack_pack_bin_with_body(pk, zeros, 0); break;
    case BAD_BIN65: msgpack_pack_bin_with_body(pk, zeros, 65); break;
    case BAD_EXT: msgpack_pack_ext_with_body(pk, zeros, 4, 5); break;
    case BAD_ARRAY_OF_STR:
        msgpack_pack_array(pk, 1);
        pack_cstr(pk, "x");
        break;
    case BAD_ARRAY_OF_FLOAT:
        msgpack_pack_array(pk, 1);
        msgpack_pack_double(pk, 2.5);
        break;
    case BAD_ARRAY_OF_NIL:
        msgpack_pack_array(pk, 1);
        msgpack_pack_nil(pk);
        break;
    case BAD_ARRAY_OF_NEG:
        msgpack_pack_array(pk, 1);
        msgpack_pack_int8(pk, -2);
        break;
    case BAD_ARRAY_OF_U32_OVER:
        msgpack_pack_array(pk, 1);
        msgpack_pack_uint64(pk, (uint64_t)1 << 32);
        break;
    case BAD_ARRAY_OF_BIN0:
        msgpack_pack_array(pk, 1);
        msgpack_pack_bin_with_body(pk, zeros, 0);
        break;
    case BAD_ARRAY_OF_BIN65:
        msgpack_pack_array(pk, 1);
        msgpack_pack_bin_with_body(pk, zeros, 65);
        break;
    case BAD_ARRAY_OF_MAP:
        msgpack_pack_array(pk, 1);
        msgpack_pack_map(pk, 0);
        break;
    }
}

/* ---- BlockStored / BlockRemoved specs ---------------------------------------------------------- */

enum stored_field {
    F_BLOCK_HASHES,
    F_PARENT_BLOCK_HASH,
    F_TOKEN_IDS,
    F_BLOCK_SIZE,
    F_LORA_ID,
    F_MEDIUM,
    F_LORA_NAME,
    F_EXTRA_KEYS,
    F_GROUP_IDX,
    F_KV_CACHE_SPEC_KIND,
    F_KV_CACHE_SPEC_SLIDING_WINDOW,
    F_STORED_COUNT
};

static const char *const stored_field_names[F_STORED_COUNT] = {
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
};

enum removed_field { R_BLOCK_HASHES, R_MEDIUM, R_GROUP_IDX, R_REMOVED_COUNT };
static const char *const removed_field_names[R_REMOVED_COUNT] = {"block_hashes", "medium",
                                                                 "group_idx"};

static const uint64_t two_hashes[2] = {0x1111111111111111ull, 0xfedcba9876543210ull};
static const uint32_t eight_tokens[8] = {1, 2, 3, 4, 5, 6, 7, 4294967295u};

typedef struct stored_spec {
    bool as_map;
    unsigned n_fields;    /* fields emitted after the type name (trailing ones omitted) */
    unsigned junk_fields; /* positional: extra trailing values; map: unknown keys */
    const uint64_t *hashes;
    uint32_t n_hashes;
    bool has_parent;
    uint64_t parent;
    const uint32_t *tokens;
    uint32_t n_tokens;
    int64_t block_size;
    bool has_lora_id;
    int64_t lora_id;
    const char *medium;
    const char *lora_name;
    int extra_keys; /* -1: nil; else that many entries: nil, ["salt"], [] cycling */
    bool has_group_idx;
    uint32_t group_idx;
    const char *kv_cache_spec_kind;
    bool has_window;
    int64_t window;
    int bad_field; /* -1: none; else that field's value is replaced by `bad` */
    bad_value bad;
} stored_spec;

static stored_spec stored_default(void)
{
    stored_spec s = {
        .n_fields = F_STORED_COUNT,
        .hashes = two_hashes,
        .n_hashes = 2,
        .tokens = eight_tokens,
        .n_tokens = 8,
        .block_size = 4,
        .medium = "GPU",
        .extra_keys = -1,
        .bad_field = -1,
    };
    return s;
}

static void pack_stored_field(msgpack_packer *pk, const stored_spec *s, int f)
{
    if (f == s->bad_field) {
        pack_bad(pk, s->bad);
        return;
    }
    switch (f) {
    case F_BLOCK_HASHES: pack_u64s(pk, s->hashes, s->n_hashes); break;
    case F_PARENT_BLOCK_HASH:
        if (s->has_parent)
            msgpack_pack_uint64(pk, s->parent);
        else
            msgpack_pack_nil(pk);
        break;
    case F_TOKEN_IDS: pack_u32s(pk, s->tokens, s->n_tokens); break;
    case F_BLOCK_SIZE: msgpack_pack_int64(pk, s->block_size); break;
    case F_LORA_ID:
        if (s->has_lora_id)
            msgpack_pack_int64(pk, s->lora_id);
        else
            msgpack_pack_nil(pk);
        break;
    case F_MEDIUM: pack_opt_cstr(pk, s->medium); break;
    case F_LORA_NAME: pack_opt_cstr(pk, s->lora_name); break;
    case F_EXTRA_KEYS:
        if (s->extra_keys < 0) {
            msgpack_pack_nil(pk);
            break;
        }
        msgpack_pack_array(pk, (size_t)s->extra_keys);
        for (int i = 0; i < s->extra_keys; i++) {
            if (i % 3 == 0) {
                msgpack_pack_nil(pk);
            } else if (i % 3 == 1) {
                msgpack_pack_array(pk, 2);
                pack_cstr(pk, "salt");
                msgpack_pack_array(pk, 2); /* a multimodal (hash, offset) pair */
                pack_cstr(pk, "mm-hash");
                msgpack_pack_uint8(pk, 3);
            } else {
                msgpack_pack_array(pk, 0);
            }
        }
        break;
    case F_GROUP_IDX:
        if (s->has_group_idx)
            msgpack_pack_uint32(pk, s->group_idx);
        else
            msgpack_pack_nil(pk);
        break;
    case F_KV_CACHE_SPEC_KIND: pack_opt_cstr(pk, s->kv_cache_spec_kind); break;
    case F_KV_CACHE_SPEC_SLIDING_WINDOW:
        if (s->has_window)
            msgpack_pack_int64(pk, s->window);
        else
            msgpack_pack_nil(pk);
        break;
    }
}

/* Unknown fields a newer engine may add: scalars and nested containers. */
static void pack_junk_value(msgpack_packer *pk, unsigned i)
{
    switch (i % 4) {
    case 0: pack_cstr(pk, "LOCAL"); break;
    case 1:
        msgpack_pack_array(pk, 2);
        msgpack_pack_uint8(pk, 1);
        msgpack_pack_map(pk, 1);
        pack_cstr(pk, "x");
        msgpack_pack_double(pk, 0.5);
        break;
    case 2: msgpack_pack_nil(pk); break;
    default: msgpack_pack_bin_with_body(pk, "\x01\x02", 2); break;
    }
}

static void pack_stored(msgpack_packer *pk, const stored_spec *s)
{
    static const char *const junk_keys[] = {"locality",     "ownership", "session_id",
                                            "token_offset", "is_eagle",  "block_mm_infos"};
    if (s->as_map) {
        msgpack_pack_map(pk, 1 + s->n_fields + s->junk_fields);
        /* Unknown keys first, then the type in the middle: key order must not matter. */
        for (unsigned j = 0; j < s->junk_fields; j++) {
            pack_cstr(pk, junk_keys[j % 6]);
            pack_junk_value(pk, j);
        }
        for (unsigned f = 0; f < s->n_fields; f++) {
            if (f == 2) {
                pack_cstr(pk, "type");
                pack_cstr(pk, "BlockStored");
            }
            pack_cstr(pk, stored_field_names[f]);
            pack_stored_field(pk, s, (int)f);
        }
        if (s->n_fields <= 2) {
            pack_cstr(pk, "type");
            pack_cstr(pk, "BlockStored");
        }
        return;
    }
    msgpack_pack_array(pk, 1 + s->n_fields + s->junk_fields);
    pack_cstr(pk, "BlockStored");
    for (unsigned f = 0; f < s->n_fields; f++)
        pack_stored_field(pk, s, (int)f);
    for (unsigned j = 0; j < s->junk_fields; j++)
        pack_junk_value(pk, j);
}

typedef struct removed_spec {
    bool as_map;
    unsigned n_fields;
    unsigned junk_fields;
    const uint64_t *hashes;
    uint32_t n_hashes;
    const char *medium;
    bool has_group_idx;
    uint32_t group_idx;
    int bad_field;
    bad_value bad;
} removed_spec;

static removed_spec removed_default(void)
{
    removed_spec s = {.n_fields = R_REMOVED_COUNT,
                      .hashes = two_hashes,
                      .n_hashes = 2,
                      .medium = "GPU",
                      .bad_field = -1};
    return s;
}

static void pack_removed_field(msgpack_packer *pk, const removed_spec *s, int f)
{
    if (f == s->bad_field) {
        pack_bad(pk, s->bad);
        return;
    }
    switch (f) {
    case R_BLOCK_HASHES: pack_u64s(pk, s->hashes, s->n_hashes); break;
    case R_MEDIUM: pack_opt_cstr(pk, s->medium); break;
    case R_GROUP_IDX:
        if (s->has_group_idx)
            msgpack_pack_uint32(pk, s->group_idx);
        else
            msgpack_pack_nil(pk);
        break;
    }
}

static void pack_removed(msgpack_packer *pk, const removed_spec *s)
{
    if (s->as_map) {
        msgpack_pack_map(pk, 1 + s->n_fields + s->junk_fields);
        pack_cstr(pk, "type");
        pack_cstr(pk, "BlockRemoved");
        for (unsigned f = 0; f < s->n_fields; f++) {
            pack_cstr(pk, removed_field_names[f]);
            pack_removed_field(pk, s, (int)f);
        }
        for (unsigned j = 0; j < s->junk_fields; j++) {
            pack_cstr(pk, j ? "ownership" : "locality");
            pack_junk_value(pk, j);
        }
        return;
    }
    msgpack_pack_array(pk, 1 + s->n_fields + s->junk_fields);
    pack_cstr(pk, "BlockRemoved");
    for (unsigned f = 0; f < s->n_fields; f++)
        pack_removed_field(pk, s, (int)f);
    for (unsigned j = 0; j < s->junk_fields; j++)
        pack_junk_value(pk, j);
}

static void pack_cleared(msgpack_packer *pk, bool as_map)
{
    if (as_map) {
        msgpack_pack_map(pk, 1);
        pack_cstr(pk, "type");
    } else {
        msgpack_pack_array(pk, 1);
    }
    pack_cstr(pk, "AllBlocksCleared");
}

/* Batch framing: [ts, events, rank]; the rank comes after the events. */
typedef enum rank_mode { RANK_ABSENT, RANK_NIL, RANK_VALUE, RANK_VALUE_THEN_EXTRA } rank_mode;

static void batch_open(msgpack_packer *pk, uint32_t n_events, rank_mode rank)
{
    msgpack_pack_array(pk, rank == RANK_ABSENT ? 2 : rank == RANK_VALUE_THEN_EXTRA ? 4 : 3);
    msgpack_pack_double(pk, 1700000000.25);
    msgpack_pack_array(pk, n_events);
}

static void batch_close(msgpack_packer *pk, rank_mode rank, uint32_t value)
{
    if (rank == RANK_NIL)
        msgpack_pack_nil(pk);
    else if (rank == RANK_VALUE || rank == RANK_VALUE_THEN_EXTRA)
        msgpack_pack_uint32(pk, value);
    if (rank == RANK_VALUE_THEN_EXTRA)
        pack_cstr(pk, "future batch field");
}

/* One-event batches. */
static void pack_stored_batch(pk_buf *b, const stored_spec *s)
{
    msgpack_packer *pk = pk_begin(b);
    batch_open(pk, 1, RANK_VALUE);
    pack_stored(pk, s);
    batch_close(pk, RANK_VALUE, 0);
}

static void pack_removed_batch(pk_buf *b, const removed_spec *s)
{
    msgpack_packer *pk = pk_begin(b);
    batch_open(pk, 1, RANK_VALUE);
    pack_removed(pk, s);
    batch_close(pk, RANK_VALUE, 0);
}

/* ---- decoding helpers -------------------------------------------------------------------------- */

static km_kv_decoder *new_decoder(const km_kv_decoder_config *cfg)
{
    km_kv_decoder *d = NULL;
    int rc = km_kv_decoder_create(cfg, &d);
    cr_assert_eq(rc, KM_OK, "km_kv_decoder_create: %s", km_error_name(rc));
    cr_assert(d);
    return d;
}

static int decode_bytes(km_kv_decoder *d, const void *data, size_t n, km_kv_batch *out)
{
    return km_kv_decode_payload(d, guarded_copy(data, n), n, out);
}

static int decode_buf(km_kv_decoder *d, const pk_buf *b, km_kv_batch *out)
{
    return decode_bytes(d, b->sb.data, b->sb.size, out);
}

#define EXPECT_OK(d, rc)                                                                           \
    cr_assert_eq((rc), KM_OK, "expected KM_OK, got %s: %s", km_error_name(rc),                     \
                 km_kv_decoder_last_error(d))

#define EXPECT_ERROR(d, rc, status, needle)                                                        \
    do {                                                                                           \
        cr_assert_eq((rc), (status), "expected %s, got %s (%s)", km_error_name(status),            \
                     km_error_name(rc), km_kv_decoder_last_error(d));                              \
        cr_assert(strstr(km_kv_decoder_last_error(d), (needle)) != NULL,                           \
                  "error \"%s\" does not mention \"%s\"", km_kv_decoder_last_error(d), (needle));  \
    } while (0)

/* A batch with one event of every kind and shape; check_reference_batch knows its content. */
static void pack_reference_batch(pk_buf *b)
{
    static const unsigned char sha[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                          11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                          22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    msgpack_packer *pk = pk_begin(b);
    batch_open(pk, 7, RANK_VALUE);
    /* 0: positional, every field */
    stored_spec s = stored_default();
    s.has_parent = true;
    s.parent = 0x8000000000000001ull;
    s.lora_name = "sql-adapter";
    s.has_lora_id = true;
    s.lora_id = 7;
    s.extra_keys = 2;
    s.has_group_idx = true;
    s.group_idx = 1;
    s.kv_cache_spec_kind = "full_attention";
    s.has_window = true;
    s.window = 4096;
    pack_stored(pk, &s);
    /* 1: map form, bytes hashes, unknown keys, only some fields */
    msgpack_pack_map(pk, 7);
    pack_cstr(pk, "locality");
    pack_cstr(pk, "LOCAL");
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockStored");
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 1);
    msgpack_pack_bin_with_body(pk, sha, 32);
    pack_cstr(pk, "parent_block_hash");
    msgpack_pack_bin_with_body(pk, sha, 16);
    pack_cstr(pk, "token_ids");
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint8(pk, 9);
    msgpack_pack_uint16(pk, 300);
    pack_cstr(pk, "block_size");
    msgpack_pack_uint8(pk, 2);
    pack_cstr(pk, "medium");
    pack_cstr(pk, "cpu");
    /* 2: positional BlockRemoved with a negative hash */
    msgpack_pack_array(pk, 3);
    pack_cstr(pk, "BlockRemoved");
    msgpack_pack_array(pk, 1);
    msgpack_pack_int64(pk, -2);
    pack_cstr(pk, "DISK");
    /* 3: unknown type */
    msgpack_pack_array(pk, 2);
    pack_cstr(pk, "BlockTransferred");
    msgpack_pack_uint8(pk, 1);
    /* 4: map BlockRemoved */
    removed_spec r = removed_default();
    r.as_map = true;
    r.medium = NULL;
    r.has_group_idx = true;
    r.group_idx = 3;
    pack_removed(pk, &r);
    /* 5: AllBlocksCleared, positional */
    pack_cleared(pk, false);
    /* 6: rejected: token count mismatch */
    stored_spec bad = stored_default();
    bad.n_tokens = 7;
    pack_stored(pk, &bad);
    batch_close(pk, RANK_VALUE, 3);
}

static void check_reference_batch(const km_kv_batch *batch)
{
    cr_assert_eq(batch->n_payload_events, 7);
    cr_assert_eq(batch->n_events, 5);
    cr_assert_eq(batch->n_unknown_events, 1);
    cr_assert_str_eq(batch->first_unknown_type, "BlockTransferred");
    cr_assert_eq(batch->n_rejected, 1);
    cr_assert(batch->has_data_parallel_rank);
    cr_assert_eq(batch->data_parallel_rank, 3);
    cr_assert(batch->timestamp == 1700000000.25);

    const km_kv_event *e = &batch->events[0];
    cr_assert_eq(e->kind, KM_KV_EVENT_BLOCK_STORED);
    cr_assert_eq(e->position, 0);
    cr_assert_eq(e->n_block_hashes, 2);
    cr_assert_eq(e->block_hashes[0], two_hashes[0]);
    cr_assert_eq(e->block_hashes[1], two_hashes[1]);
    cr_assert(e->has_parent_block_hash);
    cr_assert_eq(e->parent_block_hash, 0x8000000000000001ull);
    cr_assert_eq(e->n_token_ids, 8);
    cr_assert_arr_eq(e->token_ids, eight_tokens, sizeof eight_tokens);
    cr_assert_eq(e->block_size, 4);
    cr_assert_eq(e->medium, KM_KV_MEDIUM_GPU);
    cr_assert_str_eq(e->medium_name, "GPU");
    cr_assert_str_eq(e->lora_name, "sql-adapter");
    cr_assert(e->has_lora_id);
    cr_assert_eq(e->lora_id, 7);
    cr_assert(e->extra_keys_present);
    cr_assert_eq(e->extra_keys_present[0], 0); /* nil */
    cr_assert_eq(e->extra_keys_present[1], 1); /* ["salt", ...] */
    cr_assert(e->has_group_idx);
    cr_assert_eq(e->group_idx, 1);
    cr_assert_str_eq(e->kv_cache_spec_kind, "full_attention");
    cr_assert(e->has_kv_cache_spec_sliding_window);
    cr_assert_eq(e->kv_cache_spec_sliding_window, 4096);

    e = &batch->events[1];
    cr_assert_eq(e->kind, KM_KV_EVENT_BLOCK_STORED);
    cr_assert_eq(e->position, 1);
    cr_assert_eq(e->n_block_hashes, 1);
    cr_assert_eq(e->block_hashes[0], 0x18191a1b1c1d1e1full); /* last 8 of 32 bytes */
    cr_assert(e->has_parent_block_hash);
    cr_assert_eq(e->parent_block_hash, 0x08090a0b0c0d0e0full); /* last 8 of 16 bytes */
    cr_assert_eq(e->n_token_ids, 2);
    cr_assert_eq(e->token_ids[0], 9);
    cr_assert_eq(e->token_ids[1], 300);
    cr_assert_eq(e->block_size, 2);
    cr_assert_eq(e->medium, KM_KV_MEDIUM_CPU);
    cr_assert_str_eq(e->medium_name, "cpu");
    cr_assert_null(e->lora_name);
    cr_assert(!e->has_lora_id);
    cr_assert_null(e->extra_keys_present);
    cr_assert(!e->has_group_idx);
    cr_assert_null(e->kv_cache_spec_kind);
    cr_assert(!e->has_kv_cache_spec_sliding_window);

    e = &batch->events[2];
    cr_assert_eq(e->kind, KM_KV_EVENT_BLOCK_REMOVED);
    cr_assert_eq(e->position, 2);
    cr_assert_eq(e->n_block_hashes, 1);
    cr_assert_eq(e->block_hashes[0], 0xfffffffffffffffeull);
    cr_assert_eq(e->medium, KM_KV_MEDIUM_DISK);
    cr_assert(!e->has_group_idx);
    cr_assert_null(e->token_ids);

    e = &batch->events[3];
    cr_assert_eq(e->kind, KM_KV_EVENT_BLOCK_REMOVED);
    cr_assert_eq(e->position, 4);
    cr_assert_eq(e->n_block_hashes, 2);
    cr_assert_eq(e->medium, KM_KV_MEDIUM_GPU);
    cr_assert_null(e->medium_name);
    cr_assert(e->has_group_idx);
    cr_assert_eq(e->group_idx, 3);

    e = &batch->events[4];
    cr_assert_eq(e->kind, KM_KV_EVENT_ALL_BLOCKS_CLEARED);
    cr_assert_eq(e->position, 5);
    cr_assert_eq(e->n_block_hashes, 0);

    cr_assert_eq(batch->rejected[0].position, 6);
    cr_assert_eq(batch->rejected[0].kind, KM_KV_EVENT_BLOCK_STORED);
    cr_assert_eq(batch->rejected[0].status, KM_ERR_PARSE);
    cr_assert(strstr(batch->rejected[0].message, "token_ids has 7 tokens") != NULL, "%s",
              batch->rejected[0].message);
}

/* Decode the reference batch and check it: used after errors to prove the handle recovered. */
static void expect_reference_decodes(km_kv_decoder *d)
{
    pk_buf b;
    pack_reference_batch(&b);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert_str_eq(km_kv_decoder_last_error(d), "");
    check_reference_batch(&batch);
    pk_end(&b);
}

/* ---- lifecycle --------------------------------------------------------------------------------- */

Test(kv_events, create_destroy_and_config_validation, .timeout = 30)
{
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cr_assert_eq(cfg.max_payload_bytes, (uint64_t)64 << 20);
    cr_assert_eq(cfg.max_string_bytes, 1024);
    km_kv_decoder *d = NULL;
    cr_assert_eq(km_kv_decoder_create(&cfg, NULL), KM_ERR_NULL_POINTER);
    uint32_t *limits[] = {&cfg.max_payload_objects, &cfg.max_events_per_batch,
                          &cfg.max_hashes_per_event, &cfg.max_tokens_per_event,
                          &cfg.max_string_bytes};
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        km_kv_decoder_config_init(&cfg);
        *limits[i] = 0;
        cr_assert_eq(km_kv_decoder_create(&cfg, &d), KM_ERR_INVALID_ARGUMENT, "limit %zu = 0", i);
        cr_assert_null(d);
    }
    km_kv_decoder_config_init(&cfg);
    cfg.max_payload_bytes = 0;
    cr_assert_eq(km_kv_decoder_create(&cfg, &d), KM_ERR_INVALID_ARGUMENT);
    d = new_decoder(NULL);
    cr_assert_str_eq(km_kv_decoder_last_error(d), "");
    km_kv_decoder_destroy(d);
    km_kv_decoder_destroy(NULL);
    cr_assert_str_eq(km_kv_decoder_last_error(NULL), "");
    cr_assert_eq(km_kv_decode_payload(NULL, "x", 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_kv_decoder_get_stats(NULL, NULL), KM_ERR_NULL_POINTER);
    cr_assert_str_eq(km_kv_event_kind_name(KM_KV_EVENT_BLOCK_STORED), "BlockStored");
    cr_assert_str_eq(km_kv_event_kind_name(KM_KV_EVENT_ALL_BLOCKS_CLEARED), "AllBlocksCleared");
    cr_assert_str_eq(km_kv_event_kind_name((km_kv_event_kind)99), "unknown");
    cr_assert_str_eq(km_kv_medium_name(KM_KV_MEDIUM_DISK), "DISK");
    cr_assert_str_eq(km_kv_medium_name(KM_KV_MEDIUM_OTHER), "other");
}

/* Every value of both X-macro lists has its name; any other value, negative ones and the event
 * kinds' unused 0 included, is "unknown". */
Test(kv_events, names_of_every_listed_value_and_of_none_other, .timeout = 30)
{
#define EXPECT_NAME(function, type, enumerator, value, name)                                   \
    cr_assert_eq((int)enumerator, value);                                                      \
    cr_assert_str_eq(function((type)value), name);
#define KIND(...) EXPECT_NAME(km_kv_event_kind_name, km_kv_event_kind, __VA_ARGS__)
#define MEDIUM(...) EXPECT_NAME(km_kv_medium_name, km_kv_medium, __VA_ARGS__)
    KM_KV_EVENT_KIND_LIST(KIND)
    KM_KV_MEDIUM_LIST(MEDIUM)
#undef KIND
#undef MEDIUM
#undef EXPECT_NAME
    static const int outside[] = {-1, -1000, 5, 1 << 20};
    for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++) {
        cr_assert_str_eq(km_kv_event_kind_name((km_kv_event_kind)outside[i]), "unknown");
        cr_assert_str_eq(km_kv_medium_name((km_kv_medium)outside[i]), "unknown");
    }
    cr_assert_str_eq(km_kv_event_kind_name((km_kv_event_kind)0), "unknown");
}

Test(kv_events, null_arguments_are_errors_not_crashes, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    km_kv_batch batch;
    km_kv_message msg;
    cr_assert_eq(km_kv_decode_payload(d, NULL, 5, &batch), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_kv_decode_payload(d, "\x90", 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, NULL, 3, &msg),
                 KM_ERR_NULL_POINTER);
    km_kv_frame frames[3] = {{NULL, 0}, {NULL, 8}, {"\x90", 1}};
    cr_assert_eq(km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, frames, 3, &msg),
                 KM_ERR_NULL_POINTER);
    cr_assert_eq(km_kv_decode_message(d, (km_kv_source)7, frames, 3, &msg),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, frames, 3, NULL),
                 KM_ERR_NULL_POINTER);
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* ---- shapes that must be accepted -------------------------------------------------------------- */

Test(kv_events, reference_batch_every_kind_and_form, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    expect_reference_decodes(d);
    km_kv_decoder_stats st;
    cr_assert_eq(km_kv_decoder_get_stats(d, &st), KM_OK);
    cr_assert_eq(st.messages_decoded, 1);
    cr_assert_eq(st.events_decoded, 5);
    cr_assert_eq(st.events_rejected, 1);
    cr_assert_eq(st.events_unknown, 1);
    km_kv_decoder_destroy(d);
}

Test(kv_events, positional_and_map_forms_decode_identically, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    for (int as_map = 0; as_map <= 1; as_map++) {
        for (unsigned junk = 0; junk <= 6; junk += 3) {
            stored_spec s = stored_default();
            s.as_map = as_map;
            s.junk_fields = junk;
            s.lora_name = "adapter";
            s.extra_keys = 2;
            pk_buf b;
            pack_stored_batch(&b, &s);
            km_kv_batch batch;
            int rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert_eq(batch.n_events, 1, "as_map %d junk %u", as_map, junk);
            const km_kv_event *e = &batch.events[0];
            cr_assert_eq(e->n_block_hashes, 2);
            cr_assert_eq(e->block_hashes[1], two_hashes[1]);
            cr_assert_eq(e->n_token_ids, 8);
            cr_assert_eq(e->token_ids[7], 4294967295u);
            cr_assert_str_eq(e->lora_name, "adapter");
            cr_assert_eq(e->extra_keys_present[1], 1);
            cr_assert(!e->has_parent_block_hash);
            pk_end(&b);

            removed_spec r = removed_default();
            r.as_map = as_map;
            r.junk_fields = junk;
            r.medium = "CPU";
            pack_removed_batch(&b, &r);
            rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert_eq(batch.events[0].kind, KM_KV_EVENT_BLOCK_REMOVED);
            cr_assert_eq(batch.events[0].medium, KM_KV_MEDIUM_CPU);
            cr_assert_eq(batch.events[0].block_hashes[0], two_hashes[0]);
            pk_end(&b);
        }
    }
    km_kv_decoder_destroy(d);
}

Test(kv_events, trailing_defaults_may_be_omitted, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    for (int as_map = 0; as_map <= 1; as_map++) {
        /* Positional BlockStored needs its first 4 fields (the parent cannot be skipped there);
         * a map may leave the parent out too. */
        for (unsigned n = 4; n <= F_STORED_COUNT; n++) {
            stored_spec s = stored_default();
            s.as_map = as_map;
            s.n_fields = n;
            s.medium = NULL;
            pk_buf b;
            pack_stored_batch(&b, &s);
            km_kv_batch batch;
            int rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert_eq(batch.n_events, 1);
            const km_kv_event *e = &batch.events[0];
            cr_assert_eq(e->medium, KM_KV_MEDIUM_GPU);
            cr_assert_null(e->medium_name);
            cr_assert_null(e->lora_name);
            cr_assert(!e->has_lora_id && !e->has_group_idx && !e->has_kv_cache_spec_sliding_window);
            pk_end(&b);
        }
        for (unsigned n = 1; n <= R_REMOVED_COUNT; n++) {
            removed_spec r = removed_default();
            r.as_map = as_map;
            r.n_fields = n;
            r.medium = "DISK";
            pk_buf b;
            pack_removed_batch(&b, &r);
            km_kv_batch batch;
            int rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert_eq(batch.events[0].medium, n >= 2 ? KM_KV_MEDIUM_DISK : KM_KV_MEDIUM_GPU);
            pk_end(&b);
        }
    }
    /* A map event may omit parent_block_hash: no parent. */
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 1, RANK_ABSENT);
    msgpack_pack_map(pk, 4);
    pack_cstr(pk, "block_size");
    msgpack_pack_uint8(pk, 1);
    pack_cstr(pk, "token_ids");
    msgpack_pack_array(pk, 1);
    msgpack_pack_uint8(pk, 42);
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 1);
    msgpack_pack_uint8(pk, 5);
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockStored");
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert(!batch.events[0].has_parent_block_hash);
    cr_assert_eq(batch.events[0].token_ids[0], 42);
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

Test(kv_events, batch_rank_and_timestamp_variants, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    const rank_mode modes[] = {RANK_ABSENT, RANK_NIL, RANK_VALUE, RANK_VALUE_THEN_EXTRA};
    for (size_t m = 0; m < 4; m++) {
        for (int ts_kind = 0; ts_kind < 5; ts_kind++) {
            pk_buf b;
            msgpack_packer *pk = pk_begin(&b);
            msgpack_pack_array(pk, modes[m] == RANK_ABSENT             ? 2
                                   : modes[m] == RANK_VALUE_THEN_EXTRA ? 4
                                                                       : 3);
            double expect_ts = 0;
            switch (ts_kind) {
            case 0:
                msgpack_pack_double(pk, 12.5);
                expect_ts = 12.5;
                break;
            case 1:
                msgpack_pack_float(pk, 0.5f);
                expect_ts = 0.5;
                break;
            case 2:
                msgpack_pack_uint32(pk, 1700000000u);
                expect_ts = 1700000000.0;
                break;
            case 3:
                msgpack_pack_int8(pk, -3);
                expect_ts = -3.0;
                break;
            default:
                msgpack_pack_uint8(pk, 0);
                expect_ts = 0;
                break;
            }
            msgpack_pack_array(pk, 1);
            pack_cleared(pk, ts_kind % 2);
            batch_close(pk, modes[m], 7);
            km_kv_batch batch;
            int rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert(batch.timestamp == expect_ts, "ts kind %d: %f", ts_kind, batch.timestamp);
            bool has_rank = modes[m] == RANK_VALUE || modes[m] == RANK_VALUE_THEN_EXTRA;
            cr_assert_eq(batch.has_data_parallel_rank, has_rank);
            cr_assert_eq(batch.data_parallel_rank, has_rank ? 7u : 0u);
            cr_assert_eq(batch.n_events, 1);
            cr_assert_eq(batch.events[0].kind, KM_KV_EVENT_ALL_BLOCKS_CLEARED);
            pk_end(&b);
        }
    }
    /* An empty events array is a valid (if pointless) batch. */
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 0, RANK_NIL);
    batch_close(pk, RANK_NIL, 0);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert_eq(batch.n_events, 0);
    cr_assert_eq(batch.n_payload_events, 0);
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

Test(kv_events, hash_encodings, .timeout = 30)
{
    unsigned char bytes[64];
    for (int i = 0; i < 64; i++)
        bytes[i] = (unsigned char)(0xa0 + i);
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 1, RANK_VALUE);
    msgpack_pack_array(pk, 3);
    pack_cstr(pk, "BlockRemoved");
    msgpack_pack_array(pk, 11);
    msgpack_pack_uint64(pk, 0x8000000000000000ull); /* 2^63 */
    msgpack_pack_uint64(pk, UINT64_MAX);
    msgpack_pack_int64(pk, -1);        /* bits 0xff..ff */
    msgpack_pack_int64(pk, INT64_MIN); /* bits 0x80..00 */
    msgpack_pack_uint8(pk, 0);
    msgpack_pack_int64(pk, 5);                 /* non-negative signed encoding */
    msgpack_pack_bin_with_body(pk, bytes, 32); /* sha256 */
    msgpack_pack_bin_with_body(pk, bytes, 16); /* xxh3-128 */
    msgpack_pack_bin_with_body(pk, bytes, 8);
    msgpack_pack_bin_with_body(pk, bytes, 3); /* short: zero-extended on the left */
    msgpack_pack_bin_with_body(pk, bytes, 64);
    msgpack_pack_nil(pk);
    batch_close(pk, RANK_VALUE, 0);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    const uint64_t *h = batch.events[0].block_hashes;
    cr_assert_eq(batch.events[0].n_block_hashes, 11);
    cr_assert_eq(h[0], 0x8000000000000000ull);
    cr_assert_eq(h[1], UINT64_MAX);
    cr_assert_eq(h[2], UINT64_MAX);
    cr_assert_eq(h[3], 0x8000000000000000ull);
    cr_assert_eq(h[4], 0);
    cr_assert_eq(h[5], 5);
    /* int.from_bytes(b, "big") & (2**64 - 1): the last 8 bytes, big-endian */
    cr_assert_eq(h[6], 0xb8b9babbbcbdbebfull, "%016" PRIx64, h[6]);
    cr_assert_eq(h[7], 0xa8a9aaabacadaeafull, "%016" PRIx64, h[7]);
    cr_assert_eq(h[8], 0xa0a1a2a3a4a5a6a7ull);
    cr_assert_eq(h[9], 0xa0a1a2ull);
    cr_assert_eq(h[10], 0xd8d9dadbdcdddedfull);
    pk_end(&b);

    /* Parent hashes take the same encodings. */
    for (int kind = 0; kind < 3; kind++) {
        pk = pk_begin(&b);
        batch_open(pk, 1, RANK_VALUE);
        msgpack_pack_array(pk, 5);
        pack_cstr(pk, "BlockStored");
        msgpack_pack_array(pk, 0);
        uint64_t expect = 0;
        if (kind == 0) {
            msgpack_pack_int64(pk, -7);
            expect = (uint64_t)-7;
        } else if (kind == 1) {
            msgpack_pack_bin_with_body(pk, bytes, 32);
            expect = 0xb8b9babbbcbdbebfull;
        } else {
            msgpack_pack_uint64(pk, 0xc000000000000000ull);
            expect = 0xc000000000000000ull;
        }
        msgpack_pack_array(pk, 0);
        msgpack_pack_uint8(pk, 16);
        batch_close(pk, RANK_VALUE, 0);
        rc = decode_buf(d, &b, &batch);
        EXPECT_OK(d, rc);
        cr_assert(batch.events[0].has_parent_block_hash);
        cr_assert_eq(batch.events[0].parent_block_hash, expect);
        cr_assert_eq(batch.events[0].n_block_hashes, 0);
        pk_end(&b);
    }
    km_kv_decoder_destroy(d);
}

Test(kv_events, medium_variants, .timeout = 30)
{
    static const struct {
        const char *wire; /* NULL = nil */
        km_kv_medium medium;
    } cases[] = {
        {"GPU", KM_KV_MEDIUM_GPU},   {"gpu", KM_KV_MEDIUM_GPU},    {"Gpu", KM_KV_MEDIUM_GPU},
        {"CPU", KM_KV_MEDIUM_CPU},   {"cpu", KM_KV_MEDIUM_CPU},    {"DISK", KM_KV_MEDIUM_DISK},
        {"disk", KM_KV_MEDIUM_DISK}, {NULL, KM_KV_MEDIUM_GPU},     {"REMOTE", KM_KV_MEDIUM_OTHER},
        {"", KM_KV_MEDIUM_OTHER},    {"GPUS", KM_KV_MEDIUM_OTHER}, {"CP", KM_KV_MEDIUM_OTHER},
        /* SGLang's tiers, vLLM's offloading connector, LMCache's torch device names */
        {"CPU_PINNED", KM_KV_MEDIUM_CPU}, {"cpu_pinned", KM_KV_MEDIUM_CPU},
        {"EXTERNAL", KM_KV_MEDIUM_EXTERNAL}, {"STORAGE", KM_KV_MEDIUM_DISK},
        {"cuda", KM_KV_MEDIUM_GPU}, {"cuda:0", KM_KV_MEDIUM_GPU}, {"cuda:12", KM_KV_MEDIUM_GPU},
        {"cuda:", KM_KV_MEDIUM_OTHER}, {"cuda:1x", KM_KV_MEDIUM_OTHER},
        {"CPU_PINNEDX", KM_KV_MEDIUM_OTHER}, {"LocalCPUBackend", KM_KV_MEDIUM_OTHER},
    };
    km_kv_decoder *d = new_decoder(NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int removed = 0; removed <= 1; removed++) {
            pk_buf b;
            if (removed) {
                removed_spec r = removed_default();
                r.medium = cases[i].wire;
                pack_removed_batch(&b, &r);
            } else {
                stored_spec s = stored_default();
                s.medium = cases[i].wire;
                pack_stored_batch(&b, &s);
            }
            km_kv_batch batch;
            int rc = decode_buf(d, &b, &batch);
            EXPECT_OK(d, rc);
            cr_assert_eq(batch.events[0].medium, cases[i].medium, "medium \"%s\"",
                         cases[i].wire ? cases[i].wire : "(nil)");
            if (cases[i].wire)
                cr_assert_str_eq(batch.events[0].medium_name, cases[i].wire);
            else
                cr_assert_null(batch.events[0].medium_name);
            pk_end(&b);
        }
    }
    km_kv_decoder_destroy(d);
}

Test(kv_events, lora_extra_keys_and_hybrid_fields, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    uint64_t hashes[5] = {1, 2, 3, 4, 5};
    uint32_t tokens[10];
    for (int i = 0; i < 10; i++)
        tokens[i] = (uint32_t)(100 + i);
    for (int as_map = 0; as_map <= 1; as_map++) {
        stored_spec s = stored_default();
        s.as_map = as_map;
        s.hashes = hashes;
        s.n_hashes = 5;
        s.tokens = tokens;
        s.n_tokens = 10;
        s.block_size = 2;
        s.lora_name = "";
        s.has_lora_id = true;
        s.lora_id = -4;
        s.extra_keys = 5; /* nil, [..], [], nil, [..] */
        s.has_group_idx = true;
        s.group_idx = 4294967295u;
        s.kv_cache_spec_kind = "sliding_window";
        s.has_window = true;
        s.window = 128;
        pk_buf b;
        pack_stored_batch(&b, &s);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_OK(d, rc);
        const km_kv_event *e = &batch.events[0];
        cr_assert_str_eq(e->lora_name, "");
        cr_assert_eq(e->lora_id, -4);
        const uint8_t expect_present[5] = {0, 1, 0, 0, 1};
        cr_assert_arr_eq(e->extra_keys_present, expect_present, 5);
        cr_assert_eq(e->group_idx, 4294967295u);
        cr_assert_str_eq(e->kv_cache_spec_kind, "sliding_window");
        cr_assert_eq(e->kv_cache_spec_sliding_window, 128);
        cr_assert_eq(e->block_size, 2);
        pk_end(&b);
    }
    /* A LoRA name at exactly max_string_bytes is accepted. */
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cfg.max_string_bytes = 8;
    km_kv_decoder *small = new_decoder(&cfg);
    stored_spec s = stored_default();
    s.lora_name = "12345678";
    pk_buf b;
    pack_stored_batch(&b, &s);
    km_kv_batch batch;
    int rc = decode_buf(small, &b, &batch);
    EXPECT_OK(small, rc);
    cr_assert_str_eq(batch.events[0].lora_name, "12345678");
    pk_end(&b);
    km_kv_decoder_destroy(small);
    km_kv_decoder_destroy(d);
}

Test(kv_events, unknown_event_types_are_counted_and_skipped, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 6, RANK_VALUE);
    msgpack_pack_array(pk, 1);
    pack_cstr(pk, "SomeFutureEventWithAVeryLongNameThatIsLongerThanSixtyThreeBytesInTotal!!");
    pack_cleared(pk, true);
    msgpack_pack_map(pk, 2);
    pack_cstr(pk, "block_hashes"); /* fields of an unknown type are not checked at all */
    pack_cstr(pk, "not even an array");
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockSnapshot");
    msgpack_pack_array(pk, 1);
    pack_cstr(pk, "blockstored"); /* type names are case-sensitive */
    msgpack_pack_array(pk, 1);
    pack_cstr(pk, "");
    pack_cleared(pk, false);
    batch_close(pk, RANK_VALUE, 0);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert_eq(batch.n_unknown_events, 4);
    cr_assert_eq(batch.n_events, 2);
    cr_assert_eq(batch.events[0].position, 1);
    cr_assert_eq(batch.events[1].position, 5);
    cr_assert_eq(strlen(batch.first_unknown_type), 63);
    cr_assert(strncmp(batch.first_unknown_type, "SomeFutureEvent", 15) == 0);
    cr_assert_eq(batch.n_payload_events, 6);
    pk_end(&b);
    km_kv_decoder_stats st;
    km_kv_decoder_get_stats(d, &st);
    cr_assert_eq(st.events_unknown, 4);
    km_kv_decoder_destroy(d);
}

/* The first unknown type name is kept for logs: a NUL or a control byte in it (the publisher's
 * bytes, anything) comes out as '?', so the name is neither cut short nor able to break a line. */
Test(kv_events, unknown_type_name_has_no_nul_or_control_bytes, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 2, RANK_NIL);
    msgpack_pack_array(pk, 1);
    msgpack_pack_str_with_body(pk, "Block\0Moved\n\x1b[2J\x7f\xc3\xa9", 19);
    msgpack_pack_array(pk, 1);
    pack_cstr(pk, "SecondUnknown");
    batch_close(pk, RANK_NIL, 0);
    for (int direct = 0; direct < 2; direct++) {
        km_kv_decoder_set_direct_path(d, direct);
        km_kv_batch batch;
        EXPECT_OK(d, decode_buf(d, &b, &batch));
        cr_assert_eq(batch.n_unknown_events, 2);
        cr_assert_str_eq(batch.first_unknown_type, "Block?Moved?\?[2J?\xc3\xa9");
    }
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

/* ---- per-event rejection ----------------------------------------------------------------------- */

Test(kv_events, inconsistent_events_are_rejected_alone, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 10, RANK_VALUE);
    stored_spec ok = stored_default();
    pack_stored(pk, &ok); /* 0 */
    stored_spec s = stored_default();
    s.n_tokens = 7; /* 1: 7 tokens for 2 blocks of 4 */
    pack_stored(pk, &s);
    s = stored_default();
    s.block_size = 0; /* 2 */
    pack_stored(pk, &s);
    s = stored_default();
    s.block_size = -3; /* 3 */
    pack_stored(pk, &s);
    removed_spec r = removed_default();
    pack_removed(pk, &r); /* 4 */
    s = stored_default();
    s.extra_keys = 3; /* 5: 3 entries for 2 blocks */
    pack_stored(pk, &s);
    /* 6: NUL inside lora_name */
    msgpack_pack_array(pk, 8);
    pack_cstr(pk, "BlockStored");
    pack_u64s(pk, two_hashes, 2);
    msgpack_pack_nil(pk);
    pack_u32s(pk, eight_tokens, 8);
    msgpack_pack_uint8(pk, 4);
    msgpack_pack_nil(pk);
    msgpack_pack_nil(pk);
    msgpack_pack_str_with_body(pk, "a\0b", 3);
    pack_cleared(pk, false); /* 7 */
    s = stored_default();
    s.block_size = (int64_t)1 << 33; /* 8: above 2^32-1 */
    pack_stored(pk, &s);
    s = stored_default(); /* 9: 16 tokens for 2 blocks of 4 (too many) */
    uint32_t sixteen[16] = {0};
    s.tokens = sixteen;
    s.n_tokens = 16;
    pack_stored(pk, &s);
    batch_close(pk, RANK_VALUE, 0);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert_eq(batch.n_payload_events, 10);
    cr_assert_eq(batch.n_events, 3);
    cr_assert_eq(batch.events[0].position, 0);
    cr_assert_eq(batch.events[1].position, 4);
    cr_assert_eq(batch.events[2].position, 7);
    cr_assert_eq(batch.n_rejected, 7);
    const struct {
        uint32_t position;
        int status;
        const char *needle;
    } expect[] = {
        {1, KM_ERR_PARSE, "token_ids has 7 tokens, block_size 4 x 2 block_hashes needs 8"},
        {2, KM_ERR_BLOCK_SIZE, "block_size 0"},
        {3, KM_ERR_BLOCK_SIZE, "block_size -3"},
        {5, KM_ERR_PARSE, "extra_keys has 3 entries for 2 blocks"},
        {6, KM_ERR_PARSE, "lora_name contains a NUL byte"},
        {8, KM_ERR_BLOCK_SIZE, "above 2^32-1"},
        {9, KM_ERR_PARSE, "token_ids has 16 tokens"},
    };
    for (size_t i = 0; i < 7; i++) {
        cr_assert_eq(batch.rejected[i].position, expect[i].position, "rejected %zu", i);
        cr_assert_eq(batch.rejected[i].status, expect[i].status, "rejected %zu", i);
        cr_assert_eq(batch.rejected[i].kind, KM_KV_EVENT_BLOCK_STORED);
        cr_assert(strstr(batch.rejected[i].message, expect[i].needle) != NULL, "rejected %zu: %s",
                  i, batch.rejected[i].message);
    }
    km_kv_decoder_stats st;
    km_kv_decoder_get_stats(d, &st);
    cr_assert_eq(st.events_rejected, 7);
    cr_assert_eq(st.events_decoded, 3);
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

/* ---- placeholder stores ------------------------------------------------------------------------ */

/* vLLM's OffloadingConnector (self-describing events off) announces each chunk it stores in a
 * lower tier as BlockStored([key hash], parent nil, token_ids [], block_size 0, medium "CPU",
 * group_idx, locality, ownership): a placeholder store, delivered off the GPU only. With tokens, a
 * parent or on the GPU medium, block_size 0 stays rejected; a non-zero block size is a normal
 * store, checked as always. Positional (the direct path) and map events alike. */
Test(kv_events, placeholder_stores_are_delivered_off_the_gpu_only, .timeout = 30)
{
    static const uint64_t key_hash[1] = {0xc0ffee0000000001ull};
    for (int as_map = 0; as_map < 2; as_map++) {
        km_kv_decoder *d = new_decoder(NULL);
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        batch_open(pk, 9, RANK_VALUE);
        stored_spec ph = stored_default();
        ph.as_map = as_map;
        ph.hashes = key_hash;
        ph.n_hashes = 1;
        ph.tokens = NULL;
        ph.n_tokens = 0;
        ph.block_size = 0;
        ph.medium = "CPU";
        ph.has_group_idx = true;
        ph.group_idx = 0;
        stored_spec s = ph;
        pack_stored(pk, &s); /* 0: CPU placeholder */
        s.medium = "DISK";
        s.junk_fields = 2; /* 1: DISK, with vLLM's locality and ownership fields */
        pack_stored(pk, &s);
        s = ph;
        s.medium = "GPU"; /* 2: rejected */
        pack_stored(pk, &s);
        s.medium = NULL; /* 3: nil is the GPU: rejected */
        pack_stored(pk, &s);
        s = ph;
        s.has_parent = true; /* 4: a parent: rejected */
        s.parent = 7;
        pack_stored(pk, &s);
        s = ph;
        s.tokens = eight_tokens; /* 5: tokens: rejected */
        s.n_tokens = 8;
        pack_stored(pk, &s);
        s = stored_default();
        s.as_map = as_map;
        s.medium = "CPU"; /* 6: a full CPU store */
        pack_stored(pk, &s);
        s.n_tokens = 0; /* 7: block size 4 without tokens: token_count */
        s.tokens = NULL;
        pack_stored(pk, &s);
        s = ph;
        s.n_hashes = 0; /* 8: a placeholder of no block: delivered, names nothing */
        pack_stored(pk, &s);
        batch_close(pk, RANK_VALUE, 0);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_OK(d, rc);
        cr_assert_eq(batch.n_events, 4, "map %d", as_map);
        const uint32_t positions[4] = {0, 1, 6, 8};
        const km_kv_medium media[4] = {KM_KV_MEDIUM_CPU, KM_KV_MEDIUM_DISK, KM_KV_MEDIUM_CPU,
                                       KM_KV_MEDIUM_CPU};
        for (uint32_t i = 0; i < 4; i++) {
            const km_kv_event *e = &batch.events[i];
            cr_assert_eq(e->position, positions[i], "map %d event %u", as_map, i);
            cr_assert_eq(e->medium, media[i], "map %d event %u", as_map, i);
            cr_assert_eq(e->placeholder, i != 2, "map %d event %u", as_map, i);
            cr_assert_eq(e->block_size, i == 2 ? 4u : 0u);
            if (e->placeholder) {
                cr_assert_eq(e->n_token_ids, 0);
                cr_assert(!e->has_parent_block_hash && !e->sparse_blocks);
                cr_assert(e->has_group_idx && e->group_idx == 0);
                cr_assert_eq(e->n_block_hashes, i == 3 ? 0u : 1u);
                if (e->n_block_hashes)
                    cr_assert_eq(e->block_hashes[0], key_hash[0]);
            }
        }
        cr_assert_eq(batch.n_rejected, 5);
        const struct {
            uint32_t position;
            km_kv_rejection reason;
            const char *needle;
        } expect[] = {
            {2, KM_KV_REJECTED_BLOCK_SIZE, "names a medium other than the GPU"},
            {3, KM_KV_REJECTED_BLOCK_SIZE, "names a medium other than the GPU"},
            {4, KM_KV_REJECTED_BLOCK_SIZE, "block_size 0 is below 1"},
            {5, KM_KV_REJECTED_BLOCK_SIZE, "block_size 0 is below 1"},
            {7, KM_KV_REJECTED_TOKEN_COUNT, "token_ids has 0 tokens"},
        };
        for (size_t i = 0; i < 5; i++) {
            const km_kv_rejected_event *r = &batch.rejected[i];
            cr_assert_eq(r->position, expect[i].position, "map %d rejected %zu", as_map, i);
            cr_assert_eq(r->reason, expect[i].reason, "map %d rejected %zu", as_map, i);
            cr_assert(strstr(r->message, expect[i].needle) != NULL, "map %d rejected %zu: %s",
                      as_map, i, r->message);
        }
        cr_assert(strstr(batch.rejected[2].message, "placeholder") == NULL,
                  "a parent makes it no placeholder: %s", batch.rejected[2].message);
        pk_end(&b);
        km_kv_decoder_destroy(d);
    }
}

/* ---- wrong types: every field, both forms ------------------------------------------------------ */

static bool hashes_value_is_valid(bad_value v)
{
    return v == BAD_EMPTY_ARRAY || v == BAD_ARRAY_OF_NEG || v == BAD_ARRAY_OF_U32_OVER;
}

static bool bad_is_valid_for_stored_field(int f, bad_value v)
{
    switch (f) {
    case F_BLOCK_HASHES: return hashes_value_is_valid(v);
    case F_PARENT_BLOCK_HASH:
        return v == BAD_NIL || v == BAD_UINT || v == BAD_NEG || v == BAD_BIN3 ||
               v == BAD_U32_OVER || v == BAD_U64_MAX;
    case F_TOKEN_IDS:
        return v == BAD_EMPTY_ARRAY; /* well-typed: a count mismatch, tested elsewhere */
    case F_BLOCK_SIZE:
        return v == BAD_UINT || v == BAD_NEG || v == BAD_U32_OVER || v == BAD_U64_MAX;
    case F_LORA_ID: return v == BAD_NIL || v == BAD_UINT || v == BAD_NEG || v == BAD_U32_OVER;
    case F_MEDIUM:
    case F_LORA_NAME:
    case F_KV_CACHE_SPEC_KIND: return v == BAD_NIL || v == BAD_STR;
    case F_EXTRA_KEYS:
        return v == BAD_NIL || v == BAD_EMPTY_ARRAY || v >= BAD_ARRAY_OF_STR; /* any array */
    case F_GROUP_IDX: return v == BAD_NIL || v == BAD_UINT;
    case F_KV_CACHE_SPEC_SLIDING_WINDOW:
        return v == BAD_NIL || v == BAD_UINT || v == BAD_NEG || v == BAD_U32_OVER;
    }
    return false;
}

Test(kv_events, wrong_type_in_every_stored_field_rejects_the_batch, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    unsigned checked = 0;
    for (int as_map = 0; as_map <= 1; as_map++) {
        for (int f = 0; f < F_STORED_COUNT; f++) {
            for (int v = BAD_NIL; v <= BAD_ARRAY_OF_MAP; v++) {
                if (bad_is_valid_for_stored_field(f, (bad_value)v))
                    continue;
                stored_spec s = stored_default();
                s.as_map = as_map;
                s.bad_field = f;
                s.bad = (bad_value)v;
                pk_buf b;
                pack_stored_batch(&b, &s);
                km_kv_batch batch;
                int rc = decode_buf(d, &b, &batch);
                pk_end(&b);
                cr_assert_eq(rc, KM_ERR_PARSE, "%s form, field %s = %s: %s (%s)",
                             as_map ? "map" : "positional", stored_field_names[f],
                             bad_value_names[v], km_error_name(rc), km_kv_decoder_last_error(d));
                const char *err = km_kv_decoder_last_error(d);
                cr_assert(strstr(err, stored_field_names[f]) &&
                              strstr(err, "event 0 (BlockStored)"),
                          "error \"%s\" does not name field %s", err, stored_field_names[f]);
                cr_assert_eq(batch.n_events, 0);
                cr_assert_null(batch.events);
                checked++;
            }
            expect_reference_decodes(d);
        }
    }
    cr_assert(checked > 150, "only %u wrong-type cases checked", checked);
    km_kv_decoder_destroy(d);
}

Test(kv_events, wrong_type_in_every_removed_field_rejects_the_batch, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    for (int as_map = 0; as_map <= 1; as_map++) {
        for (int f = 0; f < R_REMOVED_COUNT; f++) {
            for (int v = BAD_NIL; v <= BAD_ARRAY_OF_MAP; v++) {
                bool valid = (f == R_BLOCK_HASHES && hashes_value_is_valid((bad_value)v)) ||
                             (f == R_MEDIUM && (v == BAD_NIL || v == BAD_STR)) ||
                             (f == R_GROUP_IDX && (v == BAD_NIL || v == BAD_UINT));
                if (valid)
                    continue;
                removed_spec r = removed_default();
                r.as_map = as_map;
                r.bad_field = f;
                r.bad = (bad_value)v;
                pk_buf b;
                pack_removed_batch(&b, &r);
                km_kv_batch batch;
                int rc = decode_buf(d, &b, &batch);
                pk_end(&b);
                cr_assert_eq(rc, KM_ERR_PARSE, "%s form, field %s = %s: %s",
                             as_map ? "map" : "positional", removed_field_names[f],
                             bad_value_names[v], km_error_name(rc));
                EXPECT_ERROR(d, rc, KM_ERR_PARSE, removed_field_names[f]);
                cr_assert(strstr(km_kv_decoder_last_error(d), "event 0 (BlockRemoved)"));
            }
        }
    }
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

Test(kv_events, missing_required_fields, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    /* Positional with fewer than 4 fields after the type. */
    for (unsigned n = 0; n < 4; n++) {
        stored_spec s = stored_default();
        s.n_fields = n;
        pk_buf b;
        pack_stored_batch(&b, &s);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, "required field missing");
        pk_end(&b);
    }
    /* Map without block_hashes / token_ids / block_size. */
    const char *required[] = {"block_hashes", "token_ids", "block_size"};
    for (int skip = 0; skip < 3; skip++) {
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        batch_open(pk, 1, RANK_VALUE);
        msgpack_pack_map(pk, 3);
        pack_cstr(pk, "type");
        pack_cstr(pk, "BlockStored");
        for (int f = 0; f < 3; f++) {
            if (f == skip)
                continue;
            pack_cstr(pk, required[f]);
            if (f == 0)
                pack_u64s(pk, two_hashes, 1);
            else if (f == 1)
                pack_u32s(pk, eight_tokens, 4);
            else
                msgpack_pack_uint8(pk, 4);
        }
        batch_close(pk, RANK_VALUE, 0);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, required[skip]);
        pk_end(&b);
    }
    /* BlockRemoved without hashes, both forms. */
    for (int as_map = 0; as_map <= 1; as_map++) {
        removed_spec r = removed_default();
        r.as_map = as_map;
        r.n_fields = 0;
        pk_buf b;
        pack_removed_batch(&b, &r);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, "block_hashes");
        pk_end(&b);
    }
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* One batch whose events array holds a single raw event built by `pack_event`. */
typedef void (*event_packer)(msgpack_packer *pk);

static void ev_int(msgpack_packer *pk)
{
    msgpack_pack_uint8(pk, 1);
}
static void ev_str(msgpack_packer *pk)
{
    pack_cstr(pk, "BlockStored");
}
static void ev_empty_array(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 0);
}
static void ev_type_int(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_uint8(pk, 1);
}
static void ev_type_bin(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_bin_with_body(pk, "BlockStored", 11);
}
static void ev_map_no_type(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 1);
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 0);
}
static void ev_map_type_nil(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 1);
    pack_cstr(pk, "type");
    msgpack_pack_nil(pk);
}
static void ev_map_two_types(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 2);
    pack_cstr(pk, "type");
    pack_cstr(pk, "AllBlocksCleared");
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockRemoved");
}
static void ev_map_duplicate_field(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 3);
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockRemoved");
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 0);
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 0);
}

Test(kv_events, malformed_events_and_batches, .timeout = 30)
{
    static const struct {
        event_packer pack;
        const char *needle;
    } events[] = {
        {ev_int, "expected an event (array or map), got non-negative int"},
        {ev_str, "got str"},
        {ev_empty_array, "empty array"},
        {ev_type_int, "field type: expected the type name as str"},
        {ev_type_bin, "got bin"},
        {ev_map_no_type, "no \"type\" key"},
        {ev_map_type_nil, "got nil"},
        {ev_map_two_types, "field type: key appears twice"},
        {ev_map_duplicate_field, "field block_hashes: key appears twice"},
    };
    km_kv_decoder *d = new_decoder(NULL);
    for (size_t i = 0; i < sizeof events / sizeof events[0]; i++) {
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        batch_open(pk, 2, RANK_VALUE);
        pack_cleared(pk, false);
        events[i].pack(pk);
        batch_close(pk, RANK_VALUE, 0);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, events[i].needle);
        cr_assert(strstr(km_kv_decoder_last_error(d), "event 1"), "%s",
                  km_kv_decoder_last_error(d));
        pk_end(&b);
    }
    expect_reference_decodes(d);

    /* Batch-level shapes, as raw bytes. */
    static const struct {
        const char *bytes;
        size_t size;
        const char *needle;
    } batches[] = {
        {"\x80", 1, "expected the batch array"},                            /* {} */
        {"\x07", 1, "expected the batch array"},                            /* 7 */
        {"\x90", 1, "at least 2 needed"},                                   /* [] */
        {"\x91\x01", 2, "at least 2 needed"},                               /* [1] */
        {"\x92\xa1x\x90", 4, "batch ts: expected a float or int, got str"}, /* ["x", []] */
        {"\x92\xc0\x90", 3, "batch ts"},                                    /* [nil, []] */
        {"\x92\x01\x80", 3, "batch events: expected an array, got map"},
        {"\x92\x01\xc0", 3, "batch events: expected an array, got nil"},
        {"\x93\x01\x90\xa1x", 5, "data_parallel_rank: expected an int or nil, got str"},
        {"\x93\x01\x90\xff", 4, "data_parallel_rank: out of range"}, /* -1 */
        {"\x93\x01\x90\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00", 12,
         "data_parallel_rank: expected an int or nil, got float"},
        {"\x93\x01\x90\xcf\x00\x00\x00\x01\x00\x00\x00\x00", 12,
         "data_parallel_rank: out of range"},
        {"\x92\x01\x90\x00", 4, "1 bytes follow the batch value"}, /* trailing byte */
        {"\x92\x01\x90\x92\x01\x90", 6, "3 bytes follow"},         /* two batches */
        {"\xc1", 1, "0xc1 at offset 0 is not a valid msgpack type"},
        {"\x92\x01\x91\xc1", 4, "0xc1 at offset 3"},
        {"", 0, "empty payload"},
    };
    for (size_t i = 0; i < sizeof batches / sizeof batches[0]; i++) {
        km_kv_batch batch;
        int rc = decode_bytes(d, batches[i].bytes, batches[i].size, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, batches[i].needle);
        cr_assert_eq(batch.n_events, 0);
    }
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* ---- truncation and lying lengths -------------------------------------------------------------- */

Test(kv_events, every_prefix_of_valid_payloads_fails_cleanly, .timeout = 60)
{
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf payloads[3];
    pack_reference_batch(&payloads[0]);
    stored_spec s = stored_default();
    s.as_map = true;
    s.junk_fields = 6;
    s.lora_name = "lora";
    s.extra_keys = 2;
    pack_stored_batch(&payloads[1], &s);
    /* long strings and arrays: str16 / array16 headers */
    msgpack_packer *pk = pk_begin(&payloads[2]);
    batch_open(pk, 1, RANK_NIL);
    uint64_t hashes[40];
    uint32_t tokens[640];
    for (int i = 0; i < 40; i++)
        hashes[i] = 0x0123456789abcdefull * (uint64_t)(i + 1);
    for (int i = 0; i < 640; i++)
        tokens[i] = (uint32_t)i * 65537u;
    char lora[300];
    memset(lora, 'L', sizeof lora - 1);
    lora[sizeof lora - 1] = 0;
    s = stored_default();
    s.hashes = hashes;
    s.n_hashes = 40;
    s.tokens = tokens;
    s.n_tokens = 640;
    s.block_size = 16;
    s.lora_name = lora;
    pack_stored(pk, &s);
    batch_close(pk, RANK_NIL, 0);

    for (int p = 0; p < 3; p++) {
        const char *data = payloads[p].sb.data;
        size_t size = payloads[p].sb.size;
        km_kv_batch batch;
        int rc = decode_bytes(d, data, size, &batch);
        EXPECT_OK(d, rc);
        for (size_t n = 0; n < size; n++) {
            rc = decode_bytes(d, data, n, &batch);
            cr_assert_eq(rc, KM_ERR_PARSE, "payload %d prefix %zu/%zu: %s (%s)", p, n, size,
                         km_error_name(rc), km_kv_decoder_last_error(d));
            cr_assert_eq(batch.n_events, 0);
        }
        pk_end(&payloads[p]);
    }
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

Test(kv_events, declared_lengths_larger_than_the_payload, .timeout = 30)
{
    /* Each would make msgpack-c allocate gigabytes if it were handed the bytes unchecked. */
    static const struct {
        const char *bytes;
        size_t size;
        const char *needle;
    } cases[] = {
        {"\xdd\xff\xff\xff\xff", 5, "array at offset 0 declares 4294967295 entries"},
        {"\xdf\xff\xff\xff\xff\x01", 6, "map at offset 0 declares 4294967295 entries"},
        {"\x92\x01\xdd\xff\xff\xff\xff\x93", 8, "array at offset 2 declares 4294967295"},
        {"\x92\x01\x91\xdc\xff\xff\xa1x", 8, "declares 65535 entries"},
        {"\x92\x01\x91\x95\xab"
         "BlockStored"
         "\xdd\x7f\xff\xff\xff",
         21, "declares 2147483647"},
        {"\x92\x01\x91\xdb\xff\xff\xff\xff", 8, "needs 4294967295 more bytes"},     /* str32 */
        {"\x92\x01\x91\xc6\x7f\xff\xff\xff\x00", 9, "needs 2147483647 more bytes"}, /* bin32 */
        {"\x92\x01\x91\xc9\x00\x01\x00\x00\x05", 9, "needs 65536 more bytes"},      /* ext32 */
        {"\x92\x01\x91\xd8\x05\x00", 6, "needs 16 more bytes"},                     /* fixext16 */
        {"\x92\xcb\x00\x00", 4, "value header at offset 1 needs 9 bytes"}, /* float64 cut */
        {"\x92\x01\x91\x92", 4, "truncated"},
    };
    km_kv_decoder *d = new_decoder(NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        km_kv_batch batch;
        int rc = decode_bytes(d, cases[i].bytes, cases[i].size, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_PARSE, cases[i].needle);
        km_kv_decoder_stats st;
        km_kv_decoder_get_stats(d, &st);
        cr_assert(st.retained_bytes < (1u << 20), "case %zu: %llu bytes retained", i,
                  (unsigned long long)st.retained_bytes);
    }
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* ---- limits ------------------------------------------------------------------------------------- */

Test(kv_events, configured_limits, .timeout = 30)
{
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cfg.max_events_per_batch = 3;
    cfg.max_hashes_per_event = 2;
    cfg.max_tokens_per_event = 8;
    cfg.max_string_bytes = 5;
    km_kv_decoder *d = new_decoder(&cfg);
    km_kv_batch batch;
    pk_buf b;
    int rc;

    /* At the limits: accepted. */
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 3, RANK_VALUE);
    stored_spec s = stored_default(); /* 2 hashes, 8 tokens */
    s.lora_name = "12345";
    pack_stored(pk, &s);
    pack_cleared(pk, false);
    pack_cleared(pk, true);
    batch_close(pk, RANK_VALUE, 0);
    rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    pk_end(&b);

    /* Over each one. */
    pk = pk_begin(&b);
    batch_open(pk, 4, RANK_VALUE);
    for (int i = 0; i < 4; i++)
        pack_cleared(pk, false);
    batch_close(pk, RANK_VALUE, 0);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "batch has 4 events, limit max_events_per_batch = 3");
    pk_end(&b);

    uint64_t three[3] = {1, 2, 3};
    s = stored_default();
    s.hashes = three;
    s.n_hashes = 3;
    pack_stored_batch(&b, &s);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "3 hashes, limit max_hashes_per_event = 2");
    pk_end(&b);
    removed_spec r = removed_default();
    r.hashes = three;
    r.n_hashes = 3;
    pack_removed_batch(&b, &r);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "max_hashes_per_event");
    pk_end(&b);

    uint32_t nine[9] = {0};
    s = stored_default();
    s.tokens = nine;
    s.n_tokens = 9;
    pack_stored_batch(&b, &s);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE,
                 "field token_ids: 9 tokens, limit max_tokens_per_event = 8");
    pk_end(&b);

    const int string_fields[] = {F_LORA_NAME, F_MEDIUM, F_KV_CACHE_SPEC_KIND};
    for (int i = 0; i < 3; i++) {
        s = stored_default();
        s.lora_name = string_fields[i] == F_LORA_NAME ? "123456" : NULL;
        s.medium = string_fields[i] == F_MEDIUM ? "REMOTE" : NULL;
        s.kv_cache_spec_kind = string_fields[i] == F_KV_CACHE_SPEC_KIND ? "abcdef" : NULL;
        pack_stored_batch(&b, &s);
        rc = decode_buf(d, &b, &batch);
        EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "6 bytes, limit max_string_bytes = 5");
        cr_assert(strstr(km_kv_decoder_last_error(d), stored_field_names[string_fields[i]]));
        pk_end(&b);
    }
    km_kv_decoder_destroy(d);

    /* Payload bytes and value count. */
    pack_reference_batch(&b);
    km_kv_decoder_config_init(&cfg);
    cfg.max_payload_bytes = b.sb.size - 1;
    d = new_decoder(&cfg);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "limit max_payload_bytes");
    km_kv_decoder_destroy(d);
    cfg.max_payload_bytes = b.sb.size;
    d = new_decoder(&cfg);
    rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    km_kv_decoder_destroy(d);
    km_kv_decoder_config_init(&cfg);
    cfg.max_payload_objects = 20;
    d = new_decoder(&cfg);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "more than max_payload_objects = 20");
    km_kv_decoder_destroy(d);
    pk_end(&b);
}

/* A map event whose unknown field nests `depth` arrays: the payload's nesting is depth + 3. */
static void pack_nested(pk_buf *b, unsigned depth)
{
    msgpack_packer *pk = pk_begin(b);
    batch_open(pk, 1, RANK_ABSENT);
    msgpack_pack_map(pk, 2);
    pack_cstr(pk, "type");
    pack_cstr(pk, "AllBlocksCleared");
    pack_cstr(pk, "future");
    for (unsigned i = 0; i < depth; i++)
        msgpack_pack_array(pk, i + 1 < depth ? 1 : 0);
}

Test(kv_events, nesting_depth_matches_msgpack_c, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    for (unsigned total = 30; total <= 40; total++) {
        pk_buf b;
        pack_nested(&b, total - 3);
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        /* What msgpack-c itself does with the same bytes, in a throwaway zone. */
        msgpack_zone zone;
        cr_assert(msgpack_zone_init(&zone, 4096));
        msgpack_object obj;
        size_t off = 0;
        msgpack_unpack_return ur = msgpack_unpack(b.sb.data, b.sb.size, &off, &zone, &obj);
        msgpack_zone_destroy(&zone);
        if (total <= KM_KV_MAX_NESTING_DEPTH) {
            EXPECT_OK(d, rc);
            cr_assert_eq(ur, MSGPACK_UNPACK_SUCCESS, "depth %u", total);
            cr_assert_eq(batch.n_events, 1);
        } else {
            EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "nested deeper than 32");
            cr_assert_neq(ur, MSGPACK_UNPACK_SUCCESS, "depth %u", total);
        }
        pk_end(&b);
    }
    /* Far deeper than the limit, and every prefix of it. */
    pk_buf b;
    pack_nested(&b, 5000);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "nested deeper");
    pk_end(&b);
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* ---- frames ------------------------------------------------------------------------------------- */

static void be64(uint64_t v, unsigned char out[8])
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)v;
        v >>= 8;
    }
}

Test(kv_events, live_and_replay_framing, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    pk_buf b;
    pack_reference_batch(&b);
    const void *payload = b.sb.data;
    size_t payload_size = b.sb.size;
    unsigned char seq[8], end[8];
    be64(0x0102030405060708ull, seq);
    memset(end, 0xff, 8);
    const char topic[] = "kv@pod-1@llama";
    km_kv_message msg;

    /* Live: [topic, seq, payload]; the default topic is empty. */
    km_kv_frame live[3] = {{topic, strlen(topic)}, {seq, 8}, {payload, payload_size}};
    int rc = km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, live, 3, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.kind, KM_KV_MESSAGE_LIVE);
    cr_assert_eq(msg.seq, 0x0102030405060708ull);
    cr_assert(msg.has_topic);
    cr_assert_str_eq(msg.topic, topic);
    cr_assert_eq(msg.topic_size, strlen(topic));
    check_reference_batch(&msg.batch);
    live[0].data = NULL;
    live[0].size = 0;
    rc = km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, live, 3, &msg);
    EXPECT_OK(d, rc);
    cr_assert(msg.has_topic);
    cr_assert_str_eq(msg.topic, "");

    /* Replay, old form [empty, seq, payload] and new form [empty, topic, seq, payload]. */
    be64(41, seq);
    km_kv_frame old_form[3] = {{"", 0}, {seq, 8}, {payload, payload_size}};
    rc = km_kv_decode_message(d, KM_KV_SOURCE_REPLAY, old_form, 3, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.kind, KM_KV_MESSAGE_REPLAY_ITEM);
    cr_assert_eq(msg.seq, 41);
    cr_assert(!msg.has_topic);
    cr_assert_str_eq(msg.topic, "");
    check_reference_batch(&msg.batch);
    km_kv_frame new_form[4] = {
        {NULL, 0}, {topic, strlen(topic)}, {seq, 8}, {payload, payload_size}};
    rc = km_kv_decode_message(d, KM_KV_SOURCE_REPLAY, new_form, 4, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.kind, KM_KV_MESSAGE_REPLAY_ITEM);
    cr_assert_str_eq(msg.topic, topic);
    check_reference_batch(&msg.batch);

    /* End markers, both forms. */
    km_kv_frame old_end[3] = {{"", 0}, {end, 8}, {"", 0}};
    rc = km_kv_decode_message(d, KM_KV_SOURCE_REPLAY, old_end, 3, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.kind, KM_KV_MESSAGE_REPLAY_END);
    cr_assert_eq(msg.seq, KM_KV_REPLAY_END_SEQ);
    cr_assert_eq(msg.batch.n_events, 0);
    cr_assert_null(msg.batch.events);
    km_kv_frame new_end[4] = {{"", 0}, {"", 0}, {end, 8}, {NULL, 0}};
    rc = km_kv_decode_message(d, KM_KV_SOURCE_REPLAY, new_end, 4, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.kind, KM_KV_MESSAGE_REPLAY_END);
    cr_assert(msg.has_topic);

    /* Errors, each followed by a good decode on the same handle. */
    unsigned char seq7[7] = {0}, seq9[9] = {0};
    const struct {
        km_kv_source source;
        km_kv_frame frames[6];
        size_t n;
        int status;
        const char *needle;
    } bad[] = {
        {KM_KV_SOURCE_SUBSCRIBER, {{0}}, 0, KM_ERR_PARSE, "live message has 0 frames, expected 3"},
        {KM_KV_SOURCE_SUBSCRIBER, {{payload, payload_size}}, 1, KM_ERR_PARSE, "has 1 frames"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{seq, 8}, {payload, payload_size}},
         2,
         KM_ERR_PARSE,
         "has 2 frames"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {"", 0}, {seq, 8}, {payload, payload_size}},
         4,
         KM_ERR_PARSE,
         "has 4 frames"},
        {KM_KV_SOURCE_REPLAY, {{"", 0}, {seq, 8}}, 2, KM_ERR_PARSE, "replay reply has 2 frames"},
        {KM_KV_SOURCE_REPLAY,
         {{"", 0}, {"", 0}, {"", 0}, {seq, 8}, {payload, payload_size}},
         5,
         KM_ERR_PARSE,
         "replay reply has 5 frames"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {seq7, 7}, {payload, payload_size}},
         3,
         KM_ERR_PARSE,
         "seq frame (frame 1) has 7 bytes, expected 8"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {seq9, 9}, {payload, payload_size}},
         3,
         KM_ERR_PARSE,
         "has 9 bytes"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {"", 0}, {payload, payload_size}},
         3,
         KM_ERR_PARSE,
         "has 0 bytes"},
        {KM_KV_SOURCE_REPLAY,
         {{"", 0}, {topic, 3}, {seq7, 7}, {payload, payload_size}},
         4,
         KM_ERR_PARSE,
         "seq frame (frame 2) has 7 bytes"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {seq, 8}, {"", 0}},
         3,
         KM_ERR_PARSE,
         "live message seq 41 has an empty payload"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {end, 8}, {"", 0}},
         3,
         KM_ERR_PARSE,
         "this came from the SUB socket"},
        {KM_KV_SOURCE_REPLAY,
         {{"", 0}, {seq, 8}, {"", 0}},
         3,
         KM_ERR_PARSE,
         "replay reply seq 41 has an empty payload"},
        {KM_KV_SOURCE_REPLAY,
         {{"", 0}, {end, 8}, {payload, payload_size}},
         3,
         KM_ERR_PARSE,
         "end marker (seq 0xffffffffffffffff) carries a"},
        {KM_KV_SOURCE_REPLAY,
         {{topic, 3}, {seq, 8}, {payload, payload_size}},
         3,
         KM_ERR_PARSE,
         "frame 0 has 3 bytes, expected the empty delimiter"},
        {KM_KV_SOURCE_REPLAY,
         {{"x", 1}, {topic, 3}, {seq, 8}, {payload, payload_size}},
         4,
         KM_ERR_PARSE,
         "expected the empty delimiter"},
        {KM_KV_SOURCE_SUBSCRIBER,
         {{"", 0}, {seq, 8}, {"\x92\x01", 2}},
         3,
         KM_ERR_PARSE,
         "truncated"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rc = km_kv_decode_message(d, bad[i].source, bad[i].frames, bad[i].n, &msg);
        EXPECT_ERROR(d, rc, bad[i].status, bad[i].needle);
        cr_assert_eq(msg.kind, 0, "case %zu: out not zeroed", i);
        rc = km_kv_decode_message(d, KM_KV_SOURCE_REPLAY, new_form, 4, &msg);
        EXPECT_OK(d, rc);
        check_reference_batch(&msg.batch);
    }

    /* Topic limit. */
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cfg.max_string_bytes = 4;
    km_kv_decoder *small = new_decoder(&cfg);
    pk_buf cleared;
    msgpack_packer *cpk = pk_begin(&cleared);
    batch_open(cpk, 1, RANK_VALUE);
    pack_cleared(cpk, false);
    batch_close(cpk, RANK_VALUE, 0);
    km_kv_frame long_topic[3] = {{"abcde", 5}, {seq, 8}, {cleared.sb.data, cleared.sb.size}};
    rc = km_kv_decode_message(small, KM_KV_SOURCE_SUBSCRIBER, long_topic, 3, &msg);
    EXPECT_ERROR(small, rc, KM_ERR_TOO_LARGE, "topic frame is 5 bytes, limit max_string_bytes = 4");
    long_topic[0].size = 4;
    rc = km_kv_decode_message(small, KM_KV_SOURCE_SUBSCRIBER, long_topic, 3, &msg);
    EXPECT_OK(small, rc);
    cr_assert_str_eq(msg.topic, "abcd");
    cr_assert_eq(msg.batch.events[0].kind, KM_KV_EVENT_ALL_BLOCKS_CLEARED);
    pk_end(&cleared);
    km_kv_decoder_destroy(small);

    /* A topic with a NUL inside is delivered whole (topic_size). */
    km_kv_frame nul_topic[3] = {{"a\0b", 3}, {seq, 8}, {payload, payload_size}};
    rc = km_kv_decode_message(d, KM_KV_SOURCE_SUBSCRIBER, nul_topic, 3, &msg);
    EXPECT_OK(d, rc);
    cr_assert_eq(msg.topic_size, 3);
    cr_assert_eq(memcmp(msg.topic, "a\0b", 4), 0);

    km_kv_decoder_stats st;
    km_kv_decoder_get_stats(d, &st);
    cr_assert_eq(st.messages_rejected, sizeof bad / sizeof bad[0]);
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

/* ---- memory ------------------------------------------------------------------------------------- */

Test(kv_events, steady_state_reuses_memory_and_results_survive_frame_release, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    /* A realistic step: 200 BlockStored of 4 blocks x 16 tokens and 50 BlockRemoved. */
    pk_buf b;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 250, RANK_VALUE);
    uint64_t hashes[4];
    uint32_t tokens[64];
    for (int e = 0; e < 250; e++) {
        for (int i = 0; i < 4; i++)
            hashes[i] = (uint64_t)e * 4 + (uint64_t)i + 0x9000000000000000ull;
        for (int i = 0; i < 64; i++)
            tokens[i] = (uint32_t)(e * 64 + i);
        if (e < 200) {
            stored_spec s = stored_default();
            s.as_map = e % 2;
            s.hashes = hashes;
            s.n_hashes = 4;
            s.tokens = tokens;
            s.n_tokens = 64;
            s.block_size = 16;
            s.lora_name = "lora";
            pack_stored(pk, &s);
        } else {
            removed_spec r = removed_default();
            r.hashes = hashes;
            r.n_hashes = 4;
            pack_removed(pk, &r);
        }
    }
    batch_close(pk, RANK_VALUE, 1);

    uint64_t retained = 0;
    for (int round = 0; round < 50; round++) {
        /* The payload buffer is a fresh heap copy each round, freed right after decoding. */
        char *copy = malloc(b.sb.size);
        cr_assert(copy);
        memcpy(copy, b.sb.data, b.sb.size);
        km_kv_batch batch;
        int rc = km_kv_decode_payload(d, copy, b.sb.size, &batch);
        memset(copy, 0xAA, b.sb.size);
        free(copy);
        EXPECT_OK(d, rc);
        cr_assert_eq(batch.n_events, 250);
        for (int e = 0; e < 250; e++) {
            const km_kv_event *ev = &batch.events[e];
            cr_assert_eq(ev->block_hashes[3], (uint64_t)e * 4 + 3 + 0x9000000000000000ull);
            if (e < 200) {
                cr_assert_eq(ev->token_ids[63], (uint32_t)(e * 64 + 63));
                cr_assert_str_eq(ev->lora_name, "lora");
            }
        }
        km_kv_decoder_stats st;
        km_kv_decoder_get_stats(d, &st);
        if (round == 2)
            retained = st.retained_bytes;
        if (round > 2)
            cr_assert_eq(st.retained_bytes, retained, "round %d: memory changed in steady state",
                         round);
        /* An error in between must not disturb the steady state. */
        rc = decode_bytes(d, "\xc1", 1, &batch);
        cr_assert_eq(rc, KM_ERR_PARSE);
    }
    cr_assert(retained > 0 && retained < (64u << 20), "retained %llu",
              (unsigned long long)retained);
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

Test(kv_events, large_event_and_value_count_limit, .timeout = 60)
{
    /* One BlockStored of 2^20 tokens (65536 blocks of 16): array32 headers, every int width. */
    const uint32_t n_hashes = 1u << 16, block = 16, n_tokens = n_hashes * block;
    uint64_t *hashes = malloc(n_hashes * sizeof *hashes);
    uint32_t *tokens = malloc(n_tokens * sizeof *tokens);
    cr_assert(hashes && tokens);
    for (uint32_t i = 0; i < n_hashes; i++)
        hashes[i] = 0x9e3779b97f4a7c15ull * (i + 1);
    for (uint32_t i = 0; i < n_tokens; i++)
        tokens[i] = i * 4099u; /* spans fixint, uint16 and uint32 encodings */
    stored_spec s = stored_default();
    s.hashes = hashes;
    s.n_hashes = n_hashes;
    s.tokens = tokens;
    s.n_tokens = n_tokens;
    s.block_size = block;
    pk_buf b;
    pack_stored_batch(&b, &s);
    km_kv_decoder *d = new_decoder(NULL);
    km_kv_batch batch;
    int rc = decode_buf(d, &b, &batch);
    EXPECT_OK(d, rc);
    cr_assert_eq(batch.events[0].n_block_hashes, n_hashes);
    cr_assert_eq(batch.events[0].n_token_ids, n_tokens);
    cr_assert_arr_eq(batch.events[0].block_hashes, hashes, n_hashes * sizeof *hashes);
    cr_assert_arr_eq(batch.events[0].token_ids, tokens, n_tokens * sizeof *tokens);
    pk_end(&b);
    km_kv_decoder_destroy(d);

    /* 5 Mi one-byte values in an unknown field: over max_payload_objects (4 Mi by default), found
     * by the pre-scan before msgpack-c allocates anything. */
    const uint32_t n_values = 5u << 20;
    msgpack_packer *pk = pk_begin(&b);
    batch_open(pk, 1, RANK_ABSENT);
    msgpack_pack_map(pk, 2);
    pack_cstr(pk, "type");
    pack_cstr(pk, "AllBlocksCleared");
    pack_cstr(pk, "future");
    msgpack_pack_array(pk, n_values);
    for (uint32_t i = 0; i < n_values; i++)
        msgpack_pack_fix_uint8(pk, 0);
    d = new_decoder(NULL);
    rc = decode_buf(d, &b, &batch);
    EXPECT_ERROR(d, rc, KM_ERR_TOO_LARGE, "more than max_payload_objects = 4194304");
    km_kv_decoder_stats st;
    km_kv_decoder_get_stats(d, &st);
    cr_assert(st.retained_bytes < (1u << 20), "%llu bytes retained",
              (unsigned long long)st.retained_bytes);
    expect_reference_decodes(d);
    pk_end(&b);
    km_kv_decoder_destroy(d);
    free(hashes);
    free(tokens);
}

/* ---- random and mutated payloads ---------------------------------------------------------------- */

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whatever a successful decode returns must be self-consistent and readable in full. */
static void check_batch_invariants(const km_kv_batch *batch)
{
    KM_CHECK(batch->n_events + batch->n_rejected + batch->n_unknown_events ==
                 batch->n_payload_events,
             "event counts do not add up");
    uint64_t sink = 0;
    for (uint32_t i = 0; i < batch->n_events; i++) {
        const km_kv_event *e = &batch->events[i];
        KM_CHECK(e->kind >= KM_KV_EVENT_BLOCK_STORED && e->kind <= KM_KV_EVENT_ALL_BLOCKS_CLEARED,
                 "bad kind");
        KM_CHECK(i == 0 || e->position > batch->events[i - 1].position, "positions not increasing");
        for (uint32_t h = 0; h < e->n_block_hashes; h++)
            sink += e->block_hashes[h];
        if (e->kind == KM_KV_EVENT_BLOCK_STORED) {
            KM_CHECK(e->block_size >= 1 ||
                         (e->placeholder && e->n_token_ids == 0 && !e->has_parent_block_hash &&
                          e->medium != KM_KV_MEDIUM_GPU && !e->sparse_blocks),
                     "block_size 0 delivered outside a placeholder store");
            KM_CHECK(!e->placeholder || e->block_size == 0, "placeholder with a block size");
            if (e->sparse_blocks)
                KM_CHECK(e->has_group_idx && e->n_block_hashes > 0 &&
                             (uint64_t)e->block_size * e->n_block_hashes < e->n_token_ids &&
                             e->n_token_ids % e->block_size == 0,
                         "sparse token count");
            else
                KM_CHECK((uint64_t)e->block_size * e->n_block_hashes == e->n_token_ids,
                         "token count");
            for (uint32_t t = 0; t < e->n_token_ids; t++)
                sink += e->token_ids[t];
            if (e->extra_keys_present)
                for (uint32_t h = 0; h < e->n_block_hashes; h++)
                    sink += e->extra_keys_present[h];
            if (e->lora_name)
                sink += strlen(e->lora_name);
            if (e->kv_cache_spec_kind)
                sink += strlen(e->kv_cache_spec_kind);
        }
        if (e->medium_name)
            sink += strlen(e->medium_name);
    }
    for (uint32_t i = 0; i < batch->n_rejected; i++)
        sink += strlen(batch->rejected[i].message);
    if (batch->first_unknown_type)
        sink += strlen(batch->first_unknown_type);
    (void)sink;
}

static void check_decode_outcome(km_kv_decoder *d, int rc, const km_kv_batch *batch)
{
    const char *err = km_kv_decoder_last_error(d);
    if (rc == KM_OK) {
        KM_CHECK(err[0] == 0, "error text after success: %s", err);
        check_batch_invariants(batch);
    } else {
        KM_CHECK(rc == KM_ERR_PARSE || rc == KM_ERR_TOO_LARGE, "unexpected status %s (%s)",
                 km_error_name(rc), err);
        KM_CHECK(strncmp(err, km_error_name(rc), strlen(km_error_name(rc))) == 0,
                 "error text \"%s\" does not start with the status", err);
        KM_CHECK(batch->n_events == 0 && batch->events == NULL, "output not cleared on error");
    }
}

static const unsigned char interesting_bytes[] = {
    0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc4, 0xc6, 0xc7,
    0xc9, 0xca, 0xcb, 0xcf, 0xd3, 0xd4, 0xd8, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff};

Test(kv_events, random_and_mutated_payloads, .timeout = 120)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cfg.max_events_per_batch = 64; /* small limits: mutations reach them too */
    cfg.max_tokens_per_event = 4096;
    km_kv_decoder *d = new_decoder(&cfg);

    pk_buf seeds[3];
    pack_reference_batch(&seeds[0]);
    stored_spec s = stored_default();
    s.as_map = true;
    s.junk_fields = 4;
    s.lora_name = "x";
    s.extra_keys = 2;
    pack_stored_batch(&seeds[1], &s);
    removed_spec r = removed_default();
    r.junk_fields = 2;
    pack_removed_batch(&seeds[2], &r);

    unsigned char buf[4096];
    const double deadline = now_seconds() + 4.0;
    unsigned iterations = 0, accepted = 0;
    for (; iterations < 200000 && now_seconds() < deadline; iterations++) {
        size_t n;
        if (iterations % 4 == 0) {
            /* random bytes, often starting like a batch */
            n = km_rng_below(&rng, 200);
            for (size_t i = 0; i < n; i++)
                buf[i] = km_rng_percent(&rng, 30)
                             ? interesting_bytes[km_rng_below(&rng, sizeof interesting_bytes)]
                             : (unsigned char)km_rng_next(&rng);
            if (n >= 3 && km_rng_percent(&rng, 50)) {
                buf[0] = 0x93;
                buf[1] = 0x01;
                buf[2] = (unsigned char)(0x90 | km_rng_below(&rng, 4));
            }
        } else {
            const pk_buf *seed = &seeds[km_rng_below(&rng, 3)];
            n = seed->sb.size;
            memcpy(buf, seed->sb.data, n);
            unsigned mutations = 1 + km_rng_below(&rng, 4);
            for (unsigned m = 0; m < mutations && n > 0; m++) {
                size_t at = km_rng_below(&rng, (uint32_t)n);
                switch (km_rng_below(&rng, 6)) {
                case 0: buf[at] = (unsigned char)km_rng_next(&rng); break;
                case 1:
                    buf[at] = interesting_bytes[km_rng_below(&rng, sizeof interesting_bytes)];
                    break;
                case 2: buf[at] ^= (unsigned char)(1u << km_rng_below(&rng, 8)); break;
                case 3: /* delete a byte */
                    memmove(buf + at, buf + at + 1, n - at - 1);
                    n--;
                    break;
                case 4: /* insert a byte */
                    if (n < sizeof buf) {
                        memmove(buf + at + 1, buf + at, n - at);
                        buf[at] = interesting_bytes[km_rng_below(&rng, sizeof interesting_bytes)];
                        n++;
                    }
                    break;
                default: /* truncate */ n = at; break;
                }
            }
        }
        km_kv_batch batch;
        int rc = decode_bytes(d, buf, n, &batch);
        check_decode_outcome(d, rc, &batch);
        accepted += rc == KM_OK;
        if (iterations % 500 == 0)
            expect_reference_decodes(d);
    }
    expect_reference_decodes(d);
    cr_log_info("kv_events fuzz: %u payloads, %u accepted", iterations, accepted);
    KM_CHECK(iterations >= 2000, "only %u iterations in the time budget", iterations);
    for (int i = 0; i < 3; i++)
        pk_end(&seeds[i]);
    km_kv_decoder_destroy(d);
}

/* Well-formed msgpack of random shape in every position: exercises the type checks rather than
 * the byte parser. */
static void pack_random_value(msgpack_packer *pk, km_rng *rng, unsigned depth)
{
    unsigned kind = km_rng_below(rng, depth > 3 ? 9 : 12);
    switch (kind) {
    case 0: msgpack_pack_nil(pk); break;
    case 1: msgpack_pack_true(pk); break;
    case 2: msgpack_pack_uint64(pk, km_rng_next(rng) >> km_rng_below(rng, 64)); break;
    case 3:
        msgpack_pack_int64(pk, -(int64_t)(km_rng_next(rng) >> (1 + km_rng_below(rng, 63))));
        break;
    case 4: msgpack_pack_double(pk, (double)km_rng_below(rng, 1000) / 7.0); break;
    case 5:
        pack_cstr(pk, (const char *[]){"GPU", "cpu", "BlockStored", "", "x"}[km_rng_below(rng, 5)]);
        break;
    case 6: {
        unsigned char bytes[70];
        uint32_t n = km_rng_below(rng, 70);
        for (uint32_t i = 0; i < n; i++)
            bytes[i] = (unsigned char)km_rng_next(rng);
        msgpack_pack_bin_with_body(pk, bytes, n);
        break;
    }
    case 7: msgpack_pack_ext_with_body(pk, "abcd", 4, 1); break;
    case 8: msgpack_pack_float(pk, 1.25f); break;
    case 9:
    case 10: {
        uint32_t n = km_rng_below(rng, 6);
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            if (km_rng_percent(rng, 50))
                msgpack_pack_uint32(pk, km_rng_below(rng, 100));
            else
                pack_random_value(pk, rng, depth + 1);
        }
        break;
    }
    default: {
        uint32_t n = km_rng_below(rng, 4);
        msgpack_pack_map(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            pack_cstr(pk, stored_field_names[km_rng_below(rng, F_STORED_COUNT)]);
            pack_random_value(pk, rng, depth + 1);
        }
        break;
    }
    }
}

Test(kv_events, random_well_formed_structures, .timeout = 120)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed() ^ 0x5bd1e995u);
    km_kv_decoder *d = new_decoder(NULL);
    const double deadline = now_seconds() + 3.0;
    unsigned iterations = 0, accepted = 0, rejected_events = 0;
    for (; iterations < 100000 && now_seconds() < deadline; iterations++) {
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        uint32_t n_events = km_rng_below(&rng, 4);
        rank_mode rank = (rank_mode)km_rng_below(&rng, 4);
        batch_open(pk, n_events, rank);
        for (uint32_t e = 0; e < n_events; e++) {
            if (km_rng_percent(&rng, 10)) {
                pack_random_value(pk, &rng, 2);
                continue;
            }
            /* A valid event with one or two fields replaced by random values. */
            stored_spec s = stored_default();
            s.as_map = km_rng_percent(&rng, 50);
            s.n_fields = 4 + km_rng_below(&rng, F_STORED_COUNT - 3);
            s.junk_fields = km_rng_below(&rng, 3);
            pk_buf field;
            msgpack_packer *fpk = pk_begin(&field);
            int replace = km_rng_percent(&rng, 80) ? (int)km_rng_below(&rng, s.n_fields) : -1;
            if (replace >= 0)
                pack_random_value(fpk, &rng, 3);
            if (s.as_map) {
                msgpack_pack_map(pk, 1 + s.n_fields);
                pack_cstr(pk, "type");
                pack_cstr(pk, "BlockStored");
            } else {
                msgpack_pack_array(pk, 1 + s.n_fields);
                pack_cstr(pk, "BlockStored");
            }
            for (unsigned f = 0; f < s.n_fields; f++) {
                if (s.as_map)
                    pack_cstr(pk, stored_field_names[f]);
                if ((int)f == replace)
                    msgpack_sbuffer_write(&b.sb, field.sb.data, field.sb.size);
                else
                    pack_stored_field(pk, &s, (int)f);
            }
            pk_end(&field);
        }
        batch_close(pk, rank, km_rng_below(&rng, 8));
        km_kv_batch batch;
        int rc = decode_buf(d, &b, &batch);
        check_decode_outcome(d, rc, &batch);
        if (rc == KM_OK) {
            accepted++;
            rejected_events += batch.n_rejected;
        }
        pk_end(&b);
    }
    cr_log_info("kv_events structures: %u payloads, %u accepted, %u events rejected", iterations,
                accepted, rejected_events);
    KM_CHECK(accepted > 0 && accepted < iterations, "degenerate: %u of %u accepted", accepted,
             iterations);
    expect_reference_decodes(d);
    km_kv_decoder_destroy(d);
}

/* ---- fixtures from msgspec (vLLM's own encoder) ------------------------------------------------- */

static unsigned char *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f,
              "cannot open %s (run the tests from the repository root; regenerate with "
              "scripts/gen-kv-event-fixtures.py)",
              path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc((size_t)n + 1);
    cr_assert(data);
    cr_assert_eq(fread(data, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return data;
}

static uint64_t json_hex_u64(json_t *v)
{
    cr_assert(json_is_string(v), "expected a hex string");
    return strtoull(json_string_value(v), NULL, 16);
}

static const char *json_opt_string(json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return v && json_is_string(v) ? json_string_value(v) : NULL;
}

static void check_fixture_event(const char *name, size_t i, const km_kv_event *e, json_t *x)
{
    cr_assert_str_eq(km_kv_event_kind_name(e->kind), json_string_value(json_object_get(x, "kind")),
                     "%s event %zu", name, i);
    cr_assert_eq(e->position, json_integer_value(json_object_get(x, "position")), "%s event %zu",
                 name, i);
    json_t *hashes = json_object_get(x, "block_hashes");
    cr_assert_eq(e->n_block_hashes, hashes ? json_array_size(hashes) : 0, "%s event %zu", name, i);
    for (size_t h = 0; hashes && h < json_array_size(hashes); h++)
        cr_assert_eq(e->block_hashes[h], json_hex_u64(json_array_get(hashes, h)),
                     "%s event %zu hash %zu: %016" PRIx64, name, i, h, e->block_hashes[h]);
    if (e->kind == KM_KV_EVENT_ALL_BLOCKS_CLEARED)
        return;
    cr_assert_str_eq(km_kv_medium_name(e->medium), json_string_value(json_object_get(x, "medium")),
                     "%s event %zu", name, i);
    const char *medium_name = json_opt_string(x, "medium_name");
    if (medium_name)
        cr_assert_str_eq(e->medium_name, medium_name);
    else
        cr_assert_null(e->medium_name);
    json_t *group = json_object_get(x, "group_idx");
    cr_assert_eq(e->has_group_idx, group && !json_is_null(group));
    if (e->has_group_idx)
        cr_assert_eq(e->group_idx, json_integer_value(group));
    if (e->kind != KM_KV_EVENT_BLOCK_STORED)
        return;
    json_t *parent = json_object_get(x, "parent_block_hash");
    cr_assert_eq(e->has_parent_block_hash, !json_is_null(parent), "%s event %zu parent", name, i);
    if (e->has_parent_block_hash)
        cr_assert_eq(e->parent_block_hash, json_hex_u64(parent), "%s event %zu parent", name, i);
    json_t *tokens = json_object_get(x, "token_ids");
    cr_assert_eq(e->n_token_ids, json_array_size(tokens));
    for (size_t t = 0; t < json_array_size(tokens); t++)
        cr_assert_eq(e->token_ids[t], (uint32_t)json_integer_value(json_array_get(tokens, t)));
    cr_assert_eq(e->block_size, json_integer_value(json_object_get(x, "block_size")));
    const char *lora = json_opt_string(x, "lora_name");
    if (lora)
        cr_assert_str_eq(e->lora_name, lora, "%s event %zu", name, i);
    else
        cr_assert_null(e->lora_name, "%s event %zu", name, i);
    json_t *lora_id = json_object_get(x, "lora_id");
    cr_assert_eq(e->has_lora_id, lora_id && !json_is_null(lora_id));
    if (e->has_lora_id)
        cr_assert_eq(e->lora_id, json_integer_value(lora_id));
    json_t *extra = json_object_get(x, "extra_keys_present");
    cr_assert_eq(e->extra_keys_present != NULL, extra && !json_is_null(extra), "%s event %zu", name,
                 i);
    for (size_t h = 0; e->extra_keys_present && h < e->n_block_hashes; h++)
        cr_assert_eq(e->extra_keys_present[h], json_integer_value(json_array_get(extra, h)));
    const char *spec_kind = json_opt_string(x, "kv_cache_spec_kind");
    if (spec_kind)
        cr_assert_str_eq(e->kv_cache_spec_kind, spec_kind);
    else
        cr_assert_null(e->kv_cache_spec_kind);
    json_t *window = json_object_get(x, "kv_cache_spec_sliding_window");
    cr_assert_eq(e->has_kv_cache_spec_sliding_window, window && !json_is_null(window));
    if (e->has_kv_cache_spec_sliding_window)
        cr_assert_eq(e->kv_cache_spec_sliding_window, json_integer_value(window));
    cr_assert_eq(e->placeholder, json_is_true(json_object_get(x, "placeholder")),
                 "%s event %zu placeholder", name, i);
}

static void check_fixture_batch(const char *name, const km_kv_batch *batch, json_t *x)
{
    cr_assert(batch->timestamp == json_number_value(json_object_get(x, "ts")), "%s ts", name);
    json_t *rank = json_object_get(x, "data_parallel_rank");
    cr_assert_eq(batch->has_data_parallel_rank, !json_is_null(rank), "%s rank", name);
    if (batch->has_data_parallel_rank)
        cr_assert_eq(batch->data_parallel_rank, json_integer_value(rank));
    json_t *events = json_object_get(x, "events");
    cr_assert_eq(batch->n_events, json_array_size(events), "%s events", name);
    for (size_t i = 0; i < json_array_size(events); i++)
        check_fixture_event(name, i, &batch->events[i], json_array_get(events, i));
    json_t *rejected = json_object_get(x, "rejected_positions");
    cr_assert_eq(batch->n_rejected, json_array_size(rejected), "%s rejected", name);
    for (size_t i = 0; i < json_array_size(rejected); i++)
        cr_assert_eq(batch->rejected[i].position, json_integer_value(json_array_get(rejected, i)));
    cr_assert_eq(batch->n_unknown_events, json_integer_value(json_object_get(x, "unknown_events")),
                 "%s unknown", name);
}

/* Frames files: a sequence of (u32 big-endian length, bytes). */
static size_t split_frames(const unsigned char *data, size_t size, km_kv_frame *frames, size_t max)
{
    size_t n = 0, pos = 0;
    while (pos < size) {
        cr_assert(pos + 4 <= size && n < max, "bad frames file");
        size_t len = (size_t)data[pos] << 24 | (size_t)data[pos + 1] << 16 |
                     (size_t)data[pos + 2] << 8 | data[pos + 3];
        pos += 4;
        cr_assert(pos + len <= size, "bad frames file");
        frames[n].data = data + pos;
        frames[n].size = len;
        n++;
        pos += len;
    }
    return n;
}

Test(kv_events, fixtures_encoded_by_msgspec, .timeout = 30)
{
    json_error_t jerr;
    json_t *root = json_load_file(FIXTURE_DIR "/expected.json", 0, &jerr);
    cr_assert(root,
              "cannot load " FIXTURE_DIR "/expected.json: %s (line %d); regenerate with "
              "scripts/gen-kv-event-fixtures.py",
              jerr.text, jerr.line);
    json_t *fixtures = json_object_get(root, "fixtures");
    cr_assert(json_array_size(fixtures) >= 8, "too few fixtures");
    km_kv_decoder *d = new_decoder(NULL);
    for (size_t i = 0; i < json_array_size(fixtures); i++) {
        json_t *fx = json_array_get(fixtures, i);
        const char *name = json_string_value(json_object_get(fx, "name"));
        char path[512];
        snprintf(path, sizeof path, FIXTURE_DIR "/%s",
                 json_string_value(json_object_get(fx, "file")));
        size_t size;
        unsigned char *data = read_file(path, &size);
        const char *source = json_string_value(json_object_get(fx, "source"));
        json_t *expect_error = json_object_get(fx, "error");
        int rc;
        if (strcmp(source, "payload") == 0) {
            km_kv_batch batch;
            rc = decode_bytes(d, data, size, &batch);
            if (!expect_error) {
                EXPECT_OK(d, rc);
                check_fixture_batch(name, &batch, json_object_get(fx, "batch"));
            }
        } else {
            km_kv_frame frames[8];
            size_t n = split_frames(data, size, frames, 8);
            km_kv_message msg;
            rc = km_kv_decode_message(
                d, strcmp(source, "replay") == 0 ? KM_KV_SOURCE_REPLAY : KM_KV_SOURCE_SUBSCRIBER,
                frames, n, &msg);
            if (!expect_error) {
                EXPECT_OK(d, rc);
                const char *kind = json_string_value(json_object_get(fx, "kind"));
                km_kv_message_kind want = strcmp(kind, "live") == 0 ? KM_KV_MESSAGE_LIVE
                                          : strcmp(kind, "replay_item") == 0
                                              ? KM_KV_MESSAGE_REPLAY_ITEM
                                              : KM_KV_MESSAGE_REPLAY_END;
                cr_assert_eq(msg.kind, want, "%s kind", name);
                cr_assert_eq(msg.seq, json_hex_u64(json_object_get(fx, "seq")), "%s seq", name);
                json_t *topic = json_object_get(fx, "topic");
                cr_assert_eq(msg.has_topic, !json_is_null(topic), "%s topic", name);
                if (msg.has_topic)
                    cr_assert_str_eq(msg.topic, json_string_value(topic));
                if (want != KM_KV_MESSAGE_REPLAY_END)
                    check_fixture_batch(name, &msg.batch, json_object_get(fx, "batch"));
            }
        }
        if (expect_error)
            EXPECT_ERROR(d, rc,
                         strcmp(json_string_value(expect_error), "KM_ERR_TOO_LARGE") == 0
                             ? KM_ERR_TOO_LARGE
                             : KM_ERR_PARSE,
                         json_string_value(json_object_get(fx, "error_mentions")));
        free(data);
    }
    json_decref(root);
    km_kv_decoder_destroy(d);
}

/* A map BlockStored of 2 blocks of 2 tokens with the keys that came after vLLM's positional
 * fields: lookahead_token_ids (vLLM 0.33, `lookahead` packs it unless NULL; n_lists lists of
 * `per_list` tokens, the last one `last_len` long) and cache_salt (SGLang). */
static void pack_map_stored_extras(pk_buf *b, bool has_parent, uint32_t n_lists, uint32_t per_list,
                                   uint32_t last_len, const char *salt, bool lookahead_as_str)
{
    msgpack_packer *pk = pk_begin(b);
    msgpack_pack_array(pk, 3);
    msgpack_pack_double(pk, 1.0);
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 7 + (salt ? 1 : 0));
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockStored");
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint64(pk, 1);
    msgpack_pack_uint64(pk, 2);
    pack_cstr(pk, "parent_block_hash");
    if (has_parent)
        msgpack_pack_uint64(pk, 9);
    else
        msgpack_pack_nil(pk);
    pack_cstr(pk, "token_ids");
    msgpack_pack_array(pk, 4);
    for (uint32_t i = 0; i < 4; i++)
        msgpack_pack_uint32(pk, 10 + i);
    pack_cstr(pk, "block_size");
    msgpack_pack_uint32(pk, 2);
    pack_cstr(pk, "lora_id");
    msgpack_pack_nil(pk);
    pack_cstr(pk, "lookahead_token_ids");
    if (lookahead_as_str) {
        pack_cstr(pk, "12");
    } else {
        msgpack_pack_array(pk, n_lists);
        for (uint32_t l = 0; l < n_lists; l++) {
            uint32_t len = l + 1 == n_lists ? last_len : per_list;
            msgpack_pack_array(pk, len);
            for (uint32_t t = 0; t < len; t++)
                msgpack_pack_uint32(pk, 100 * (l + 1) + t);
        }
    }
    if (salt) {
        pack_cstr(pk, "cache_salt");
        pack_cstr(pk, salt);
    }
    msgpack_pack_nil(pk); /* data_parallel_rank */
}

/* A map BlockStored of `n_hashes` hashes, `n_tokens` tokens, block size 2, group_idx unless
 * group < 0. */
static void pack_map_stored_group(pk_buf *b, uint32_t n_hashes, uint32_t n_tokens, int group)
{
    msgpack_packer *pk = pk_begin(b);
    msgpack_pack_array(pk, 3);
    msgpack_pack_double(pk, 1.0);
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 5 + (group >= 0 ? 1 : 0));
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockStored");
    pack_cstr(pk, "block_hashes");
    msgpack_pack_array(pk, n_hashes);
    for (uint32_t i = 0; i < n_hashes; i++)
        msgpack_pack_uint64(pk, 1 + i);
    pack_cstr(pk, "parent_block_hash");
    msgpack_pack_nil(pk);
    pack_cstr(pk, "token_ids");
    msgpack_pack_array(pk, n_tokens);
    for (uint32_t i = 0; i < n_tokens; i++)
        msgpack_pack_uint32(pk, 10 + i);
    pack_cstr(pk, "block_size");
    msgpack_pack_uint32(pk, 2);
    if (group >= 0) {
        pack_cstr(pk, "group_idx");
        msgpack_pack_uint32(pk, (uint32_t)group);
    }
    msgpack_pack_nil(pk); /* data_parallel_rank */
}

/* A KV-cache group that keeps some blocks of a range (vLLM 0.33's Mamba align mode: token_ids of
 * the whole range, the hashes of the blocks kept) is delivered as sparse_blocks; the same token
 * counts without group_idx, or not a whole number of blocks, or fewer than the hashes need, are
 * still rejected as token_count. */
Test(kv_events, group_store_of_some_blocks_of_a_range, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    km_kv_batch batch;
    pk_buf b;
    pack_map_stored_group(&b, 1, 8, 1);
    EXPECT_OK(d, decode_buf(d, &b, &batch));
    pk_end(&b);
    cr_assert_eq(batch.n_events, 1);
    cr_assert(batch.events[0].sparse_blocks);
    cr_assert_eq(batch.events[0].n_token_ids, 8);
    cr_assert_eq(batch.events[0].group_idx, 1);
    pack_map_stored_group(&b, 2, 4, 0);
    EXPECT_OK(d, decode_buf(d, &b, &batch));
    pk_end(&b);
    cr_assert_eq(batch.n_events, 1);
    cr_assert(!batch.events[0].sparse_blocks, "one block per hash is not sparse");
    const struct {
        uint32_t hashes, tokens;
        int group;
    } bad[] = {{1, 8, -1}, {1, 7, 1}, {2, 2, 1}, {0, 4, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pack_map_stored_group(&b, bad[i].hashes, bad[i].tokens, bad[i].group);
        EXPECT_OK(d, decode_buf(d, &b, &batch));
        pk_end(&b);
        cr_assert_eq(batch.n_events, 0, "case %zu", i);
        cr_assert_eq(batch.n_rejected, 1, "case %zu", i);
        cr_assert_eq(batch.rejected[0].reason, KM_KV_REJECTED_TOKEN_COUNT, "case %zu", i);
    }
    km_kv_decoder_destroy(d);
}

Test(kv_events, lookahead_tokens_and_top_level_cache_salt, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    km_kv_batch batch;
    pk_buf b;
    pack_map_stored_extras(&b, false, 2, 1, 1, "tenant-a", false);
    EXPECT_OK(d, decode_buf(d, &b, &batch));
    pk_end(&b);
    cr_assert_eq(batch.n_events, 1);
    const km_kv_event *e = &batch.events[0];
    cr_assert_eq(e->n_lookahead_tokens, 1);
    cr_assert_eq(e->lookahead_token_ids[0], 100);
    cr_assert_eq(e->lookahead_token_ids[1], 200);
    cr_assert_str_eq(e->cache_salt, "tenant-a");
    /* With a parent the salt does not name a first block: not delivered. */
    pack_map_stored_extras(&b, true, 2, 2, 2, "tenant-a", false);
    EXPECT_OK(d, decode_buf(d, &b, &batch));
    pk_end(&b);
    cr_assert_eq(batch.n_events, 1);
    cr_assert_null(batch.events[0].cache_salt);
    cr_assert_eq(batch.events[0].n_lookahead_tokens, 2);
    cr_assert_eq(batch.events[0].lookahead_token_ids[3], 201);
    /* One list per block, all of one non-zero length: otherwise only this event is rejected. */
    const struct {
        uint32_t lists, per, last;
        const char *needle;
    } bad[] = {{1, 1, 1, "1 lists for 2 blocks"},
               {3, 1, 1, "3 lists for 2 blocks"},
               {2, 2, 1, "has 1 tokens, block 0's has 2"},
               {2, 0, 0, "empty"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pack_map_stored_extras(&b, false, bad[i].lists, bad[i].per, bad[i].last, NULL, false);
        EXPECT_OK(d, decode_buf(d, &b, &batch));
        pk_end(&b);
        cr_assert_eq(batch.n_events, 0);
        cr_assert_eq(batch.n_rejected, 1);
        cr_assert_eq(batch.rejected[0].reason, KM_KV_REJECTED_TOKEN_COUNT);
        cr_assert(strstr(batch.rejected[0].message, bad[i].needle), "%s",
                  batch.rejected[0].message);
    }
    /* A lookahead field of the wrong type is a message the decoder cannot trust. */
    pack_map_stored_extras(&b, false, 0, 0, 0, NULL, true);
    EXPECT_ERROR(d, decode_buf(d, &b, &batch), KM_ERR_PARSE, "lookahead_token_ids");
    pk_end(&b);
    cr_assert_str_eq(km_kv_rejection_name(KM_KV_REJECTED_TOKEN_COUNT), "token_count");
    cr_assert_str_eq(km_kv_rejection_name((km_kv_rejection)0), "unknown");
    km_kv_decoder_destroy(d);
}

/* A map BlockStored of two blocks whose lookahead lists are [[7, 8], [bad, 9]] or [[7, 8], [9, bad]]
 * (bad: -1 or a str); `second` puts the bad value at index 1 of list 1. */
static void pack_bad_lookahead(pk_buf *b, bool as_str, bool second)
{
    msgpack_packer *pk = pk_begin(b);
    batch_open(pk, 1, RANK_NIL);
    msgpack_pack_map(pk, 5);
    pack_cstr(pk, "type");
    pack_cstr(pk, "BlockStored");
    pack_cstr(pk, "block_hashes");
    pack_u64s(pk, two_hashes, 2);
    pack_cstr(pk, "token_ids");
    pack_u32s(pk, eight_tokens, 8);
    pack_cstr(pk, "block_size");
    msgpack_pack_uint32(pk, 4);
    pack_cstr(pk, "lookahead_token_ids");
    msgpack_pack_array(pk, 2);
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint32(pk, 7);
    msgpack_pack_uint32(pk, 8);
    msgpack_pack_array(pk, 2);
    if (second)
        msgpack_pack_uint32(pk, 9);
    if (as_str)
        pack_cstr(pk, "x");
    else
        msgpack_pack_int64(pk, -1);
    if (!second)
        msgpack_pack_uint32(pk, 9);
    batch_close(pk, RANK_NIL, 0);
}

/* A bad token in a lookahead list is named by its list and its place in the list. */
Test(kv_events, lookahead_errors_name_the_list_and_the_token, .timeout = 30)
{
    km_kv_decoder *d = new_decoder(NULL);
    km_kv_batch batch;
    pk_buf b;
    pack_bad_lookahead(&b, false, false);
    EXPECT_ERROR(d, decode_buf(d, &b, &batch), KM_ERR_PARSE,
                 "field lookahead_token_ids[1][0]: token id out of range");
    pk_end(&b);
    pack_bad_lookahead(&b, true, true);
    EXPECT_ERROR(d, decode_buf(d, &b, &batch), KM_ERR_PARSE,
                 "field lookahead_token_ids[1][1]: expected an int in 0..2^32-1, got str");
    pk_end(&b);
    km_kv_decoder_destroy(d);
}

/* ---- the direct path against the tree path ------------------------------------------------------ */

/* An integer in one of msgpack's encodings, as a publisher might pick it: fixint, uint 8..64, or
 * the signed forms (msgpack-c reads a non-negative signed value as unsigned; the decoder must
 * too). */
static void pack_any_int(msgpack_packer *pk, km_rng *r, int64_t v)
{
    switch (km_rng_below(r, 4)) {
    case 0: msgpack_pack_int64(pk, v); break; /* the smallest encoding */
    case 1:
        if (v >= 0)
            msgpack_pack_fix_uint64(pk, (uint64_t)v);
        else
            msgpack_pack_fix_int64(pk, v);
        break;
    case 2:
        if (v >= INT32_MIN && v <= INT32_MAX)
            msgpack_pack_fix_int32(pk, (int32_t)v);
        else
            msgpack_pack_fix_int64(pk, v);
        break;
    default:
        if (v >= 0 && v <= UINT16_MAX)
            msgpack_pack_fix_uint16(pk, (uint16_t)v);
        else
            msgpack_pack_int64(pk, v);
        break;
    }
}

/* A value for an optional field: mostly nil or the field's usual type, sometimes another. */
static void pack_optional(msgpack_packer *pk, km_rng *r, int usual)
{
    uint32_t k = km_rng_below(r, 10);
    if (k < 5)
        msgpack_pack_nil(pk);
    else if (k < 8 && usual == 'i')
        pack_any_int(pk, r, (int64_t)km_rng_below(r, 100) - 10);
    else if (k < 8 && usual == 's')
        pack_cstr(pk, km_rng_below(r, 2) ? "GPU" : km_rng_below(r, 2) ? "cpu" : "other\0x");
    else if (k == 8)
        msgpack_pack_array(pk, 0);
    else
        pack_cstr(pk, "x");
}

/* One random event near the common positional form, with one deviation now and then. */
static void pack_random_event(msgpack_packer *pk, km_rng *r)
{
    uint32_t kind = km_rng_below(r, 20);
    if (kind == 0) { /* a cleared event, sometimes with extra elements or as a map */
        uint32_t extra = km_rng_below(r, 3) == 0 ? 1 : 0;
        msgpack_pack_array(pk, 1 + extra);
        pack_cstr(pk, "AllBlocksCleared");
        if (extra)
            msgpack_pack_nil(pk);
        return;
    }
    if (kind == 1) { /* a type the decoder does not know, or a map event */
        if (km_rng_below(r, 2)) {
            msgpack_pack_array(pk, 2);
            pack_cstr(pk, "BlockMoved");
            msgpack_pack_nil(pk);
        } else {
            msgpack_pack_map(pk, 2);
            pack_cstr(pk, "type");
            pack_cstr(pk, "BlockRemoved");
            pack_cstr(pk, "block_hashes");
            msgpack_pack_array(pk, 1);
            msgpack_pack_uint64(pk, 7);
        }
        return;
    }
    bool stored = kind < 12;
    uint32_t n_blocks = km_rng_below(r, 4);
    uint32_t block_size = 1 + km_rng_below(r, 4);
    uint32_t n_fields = stored ? 3 + km_rng_below(r, 10) : km_rng_below(r, 5); /* after the tag */
    msgpack_pack_array(pk, 1 + n_fields);
    pack_cstr(pk, stored ? "BlockStored" : "BlockRemoved");
    for (uint32_t f = 0; f < n_fields; f++) {
        bool deviate = km_rng_below(r, 40) == 0;
        if (f == 0) { /* block_hashes: ints of any sign and encoding, now and then bytes */
            msgpack_pack_array(pk, n_blocks);
            for (uint32_t i = 0; i < n_blocks; i++) {
                if (deviate && i == 0)
                    msgpack_pack_bin_with_body(pk, "\x01\x02", 2);
                else
                    pack_any_int(pk, r, (int64_t)km_rng_next(r));
            }
        } else if (!stored) {
            pack_optional(pk, r, f == 1 ? 's' : 'i'); /* medium, group_idx, then past the schema */
        } else if (f == 1) { /* parent */
            if (km_rng_below(r, 3) == 0)
                msgpack_pack_nil(pk);
            else
                pack_any_int(pk, r, (int64_t)km_rng_next(r));
        } else if (f == 2) { /* token_ids, the right count unless deviating */
            uint32_t n = n_blocks * block_size + (deviate ? 1 : 0);
            msgpack_pack_array(pk, n);
            for (uint32_t i = 0; i < n; i++)
                pack_any_int(pk, r, deviate && i == 0 ? -1 : (int64_t)km_rng_below(r, 200000));
        } else if (f == 3) { /* block_size */
            pack_any_int(pk, r, deviate ? 0 : block_size);
        } else {
            /* lora_id, medium, lora_name, extra_keys, group_idx, kind, sliding window, then past
             * the positional schema */
            static const char usual[] = {'i', 's', 's', 'a', 'i', 's', 'i', 'i', 'i'};
            pack_optional(pk, r, usual[f - 4]);
        }
    }
}

static void expect_same_string(const char *a, const char *b, const char *what)
{
    KM_CHECK((a == NULL) == (b == NULL) && (!a || strcmp(a, b) == 0), "%s differs", what);
}

static void expect_same_flags(const uint8_t *a, const uint8_t *b, uint32_t n, const char *what)
{
    KM_CHECK((a == NULL) == (b == NULL) && (!a || memcmp(a, b, n) == 0), "%s differs", what);
}

static void expect_same_batch(const km_kv_batch *a, const km_kv_batch *b)
{
    KM_CHECK(memcmp(&a->timestamp, &b->timestamp, sizeof a->timestamp) == 0, "timestamp");
    KM_CHECK(a->has_data_parallel_rank == b->has_data_parallel_rank &&
                 a->data_parallel_rank == b->data_parallel_rank,
             "rank");
    KM_CHECK(a->n_events == b->n_events && a->n_rejected == b->n_rejected &&
                 a->n_unknown_events == b->n_unknown_events &&
                 a->n_payload_events == b->n_payload_events,
             "counts %u/%u %u/%u %u/%u", a->n_events, b->n_events, a->n_rejected, b->n_rejected,
             a->n_unknown_events, b->n_unknown_events);
    expect_same_string(a->first_unknown_type, b->first_unknown_type, "first unknown type");
    for (uint32_t i = 0; i < a->n_rejected; i++)
        KM_CHECK(a->rejected[i].position == b->rejected[i].position &&
                     a->rejected[i].kind == b->rejected[i].kind &&
                     a->rejected[i].reason == b->rejected[i].reason &&
                     a->rejected[i].status == b->rejected[i].status &&
                     strcmp(a->rejected[i].message, b->rejected[i].message) == 0,
                 "rejected event %u", i);
    for (uint32_t i = 0; i < a->n_events; i++) {
        const km_kv_event *x = &a->events[i], *y = &b->events[i];
        KM_CHECK(x->kind == y->kind && x->position == y->position, "event %u kind", i);
        KM_CHECK(x->n_block_hashes == y->n_block_hashes &&
                     (x->n_block_hashes == 0 ||
                      memcmp(x->block_hashes, y->block_hashes, 8u * x->n_block_hashes) == 0),
                 "event %u hashes", i);
        KM_CHECK(x->medium == y->medium && x->has_group_idx == y->has_group_idx &&
                     x->group_idx == y->group_idx,
                 "event %u medium or group", i);
        expect_same_string(x->medium_name, y->medium_name, "medium name");
        KM_CHECK(x->has_parent_block_hash == y->has_parent_block_hash &&
                     x->parent_block_hash == y->parent_block_hash,
                 "event %u parent", i);
        KM_CHECK(x->placeholder == y->placeholder && x->sparse_blocks == y->sparse_blocks,
                 "event %u placeholder or sparse blocks", i);
        KM_CHECK(x->n_token_ids == y->n_token_ids && x->block_size == y->block_size &&
                     (x->n_token_ids == 0 ||
                      memcmp(x->token_ids, y->token_ids, 4u * x->n_token_ids) == 0),
                 "event %u tokens", i);
        expect_same_string(x->lora_name, y->lora_name, "lora name");
        KM_CHECK(x->has_lora_id == y->has_lora_id && x->lora_id == y->lora_id, "event %u lora", i);
        expect_same_flags(x->extra_keys_present, y->extra_keys_present, x->n_block_hashes,
                          "extra keys present");
        expect_same_flags(x->extra_keys_opaque, y->extra_keys_opaque, x->n_block_hashes,
                          "extra keys opaque");
        expect_same_string(x->cache_salt, y->cache_salt, "cache salt");
        KM_CHECK(x->n_lookahead_tokens == y->n_lookahead_tokens &&
                     (x->lookahead_token_ids == NULL) == (y->lookahead_token_ids == NULL),
                 "event %u lookahead", i);
        expect_same_string(x->kv_cache_spec_kind, y->kv_cache_spec_kind, "spec kind");
        KM_CHECK(x->has_kv_cache_spec_sliding_window == y->has_kv_cache_spec_sliding_window &&
                     x->kv_cache_spec_sliding_window == y->kv_cache_spec_sliding_window,
                 "event %u sliding window", i);
    }
}

Test(kv_events, direct_path_decodes_exactly_as_the_tree_path, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xd1ec7u);
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    cfg.max_hashes_per_event = 2; /* limits reached now and then: both paths must refuse */
    cfg.max_payload_objects = 400;
    km_kv_decoder *direct = new_decoder(&cfg), *tree = new_decoder(&cfg);
    km_kv_decoder_set_direct_path(tree, false);
    uint32_t accepted = 0;
    for (int iter = 0; iter < 20000; iter++) {
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        uint32_t items = km_rng_below(&r, 12) == 0 ? 1 + km_rng_below(&r, 4) : 3;
        uint32_t n_events = km_rng_below(&r, 8);
        msgpack_pack_array(pk, items);
        for (uint32_t i = 0; i < items; i++) {
            if (i == 0) {
                uint32_t k = km_rng_below(&r, 4);
                if (k == 0)
                    msgpack_pack_double(pk, 1.5e9 + (double)km_rng_below(&r, 1000) / 7);
                else if (k == 1)
                    msgpack_pack_float(pk, 1.25f);
                else if (k == 2)
                    pack_any_int(pk, &r, (int64_t)km_rng_below(&r, 100) - 50);
                else
                    pack_cstr(pk, "ts");
            } else if (i == 1) {
                msgpack_pack_array(pk, n_events);
                for (uint32_t e = 0; e < n_events; e++)
                    pack_random_event(pk, &r);
            } else if (i == 2) {
                uint32_t k = km_rng_below(&r, 6);
                if (k == 0)
                    msgpack_pack_nil(pk);
                else if (k == 1)
                    pack_any_int(pk, &r, -1);
                else if (k == 2)
                    msgpack_pack_uint64(pk, UINT64_C(1) << 33);
                else
                    pack_any_int(pk, &r, km_rng_below(&r, 8));
            } else {
                msgpack_pack_nil(pk);
            }
        }
        size_t size = b.sb.size;
        if (km_rng_below(&r, 20) == 0 && size > 1)
            size = km_rng_below(&r, (uint32_t)size); /* truncated */
        else if (km_rng_below(&r, 40) == 0)
            msgpack_pack_nil(pk), size = b.sb.size; /* trailing bytes */
        km_kv_batch x, y;
        int rx = decode_bytes(direct, b.sb.data, size, &x);
        int ry = decode_bytes(tree, b.sb.data, size, &y);
        KM_CHECK(rx == ry, "iteration %d: direct %s, tree %s (%s)", iter, km_error_name(rx),
                 km_error_name(ry), km_kv_decoder_last_error(tree));
        if (rx == KM_OK) {
            expect_same_batch(&x, &y);
            accepted++;
        } else {
            KM_CHECK(strcmp(km_kv_decoder_last_error(direct), km_kv_decoder_last_error(tree)) == 0,
                     "iteration %d: messages differ", iter);
        }
        pk_end(&b);
    }
    km_kv_decoder_stats sx, sy;
    km_kv_decoder_get_stats(direct, &sx);
    km_kv_decoder_get_stats(tree, &sy);
    KM_CHECK(memcmp(&sx, &sy, offsetof(km_kv_decoder_stats, retained_bytes)) == 0,
             "decoder counters differ");
    KM_CHECK(accepted > 2000, "only %u payloads decoded: the generator drifted", accepted);
    KM_CHECK(km_kv_decoder_direct_decoded(direct) > accepted / 4 &&
                 km_kv_decoder_direct_decoded(tree) == 0,
             "the direct path decoded %llu of %u payloads",
             (unsigned long long)km_kv_decoder_direct_decoded(direct), accepted);
    km_kv_decoder_destroy(direct);
    km_kv_decoder_destroy(tree);
}

/* Raw msgpack written byte by byte, so that every encoding a publisher may pick is reachable:
 * str 8 / 16 type names and media, array 16 / 32 headers, every integer width and sign form,
 * bytes hashes of 0 to 69 bytes. */
typedef struct raw_buf {
    unsigned char data[1 << 14];
    size_t size;
    km_rng *r;
} raw_buf;

static void raw_byte(raw_buf *b, unsigned v)
{
    cr_assert(b->size < sizeof b->data, "raw payload overflows");
    b->data[b->size++] = (unsigned char)v;
}

static void raw_be(raw_buf *b, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--)
        raw_byte(b, (unsigned)(v >> (8 * i)) & 0xffu);
}

static void raw_array(raw_buf *b, uint32_t n)
{
    uint32_t k = km_rng_below(b->r, 8);
    if (n < 16 && k < 6) {
        raw_byte(b, 0x90 | n);
    } else if (n < 65536 && k < 7) {
        raw_byte(b, 0xdc);
        raw_be(b, n, 2);
    } else {
        raw_byte(b, 0xdd);
        raw_be(b, n, 4);
    }
}

static void raw_str(raw_buf *b, const char *s, size_t n)
{
    uint32_t k = km_rng_below(b->r, 6);
    if (n < 32 && k < 4) {
        raw_byte(b, 0xa0 | (unsigned)n);
    } else if (n < 256 && k < 5) {
        raw_byte(b, 0xd9);
        raw_byte(b, (unsigned)n);
    } else {
        raw_byte(b, 0xda);
        raw_be(b, n, 2);
    }
    for (size_t i = 0; i < n; i++)
        raw_byte(b, (unsigned char)s[i]);
}

static void raw_uint(raw_buf *b, uint64_t v)
{
    uint32_t k = km_rng_below(b->r, 6);
    if (v < 128 && k < 2) {
        raw_byte(b, (unsigned)v);
    } else if (v < 256 && k < 3) {
        raw_byte(b, 0xcc);
        raw_be(b, v, 1);
    } else if (v < 65536 && k < 4) {
        raw_byte(b, 0xcd);
        raw_be(b, v, 2);
    } else if (v <= UINT32_MAX && k < 5) {
        raw_byte(b, 0xce);
        raw_be(b, v, 4);
    } else if (v <= INT64_MAX && km_rng_below(b->r, 3) == 0) { /* a signed form of a value >= 0 */
        int bytes = v < 128 ? 1 : v < 32768 ? 2 : v <= INT32_MAX ? 4 : 8;
        raw_byte(b, bytes == 1 ? 0xd0 : bytes == 2 ? 0xd1 : bytes == 4 ? 0xd2 : 0xd3);
        raw_be(b, v, bytes);
    } else {
        raw_byte(b, 0xcf);
        raw_be(b, v, 8);
    }
}

static void raw_int(raw_buf *b, int64_t v)
{
    if (v >= 0) {
        raw_uint(b, (uint64_t)v);
        return;
    }
    uint32_t k = km_rng_below(b->r, 4);
    if (v >= -32 && k < 2) {
        raw_byte(b, (unsigned)(uint8_t)(int8_t)v);
    } else if (v >= -128 && k < 3) {
        raw_byte(b, 0xd0);
        raw_be(b, (uint64_t)v, 1);
    } else if (v >= -32768 && k < 3) {
        raw_byte(b, 0xd1);
        raw_be(b, (uint64_t)v, 2);
    } else if (v >= INT32_MIN && k < 4) {
        raw_byte(b, 0xd2);
        raw_be(b, (uint64_t)v, 4);
    } else {
        raw_byte(b, 0xd3);
        raw_be(b, (uint64_t)v, 8);
    }
}

/* Small values and the edges of the fields' ranges. */
static int64_t raw_edge_int(km_rng *r)
{
    static const int64_t edges[] = {-1, (int64_t)UINT32_MAX, (int64_t)UINT32_MAX + 1, INT64_MAX,
                                    INT64_MIN};
    uint32_t k = km_rng_below(r, 20);
    return k < 5 ? edges[k] : (int64_t)km_rng_below(r, 40);
}

/* A value of any type, wrong for most fields. */
static void raw_junk(raw_buf *b)
{
    switch (km_rng_below(b->r, 10)) {
    case 0: raw_byte(b, 0xc0); break;
    case 1: raw_byte(b, 0xc3); break;
    case 2: raw_str(b, "x", 1); break;
    case 3: raw_byte(b, 0xcb), raw_be(b, UINT64_C(0x3ff8000000000000), 8); break; /* 1.5 */
    case 4: raw_array(b, 0); break;
    case 5: raw_byte(b, 0x80); break;
    case 6: raw_byte(b, 0xc4), raw_byte(b, 2), raw_byte(b, 1), raw_byte(b, 2); break;
    case 7: raw_byte(b, 0xd4), raw_byte(b, 1), raw_byte(b, 0); break; /* fixext 1 */
    case 8: raw_int(b, raw_edge_int(b->r)); break;
    default: raw_uint(b, UINT64_MAX); break;
    }
}

static void raw_medium(raw_buf *b, bool deviate)
{
    static const struct {
        const char *s;
        size_t n;
    } media[] = {{"GPU", 3},    {"cpu", 3},    {"CPU_PINNED", 10}, {"DISK", 4}, {"cuda:0", 6},
                 {"weird", 5},  {"", 0},       {"CP\0U", 4},       {"EXTERNAL", 8},
                 {"STORAGE", 7}};
    if (deviate) {
        raw_junk(b);
    } else if (km_rng_below(b->r, 10) < 3) {
        raw_byte(b, 0xc0);
    } else {
        uint32_t m = km_rng_below(b->r, sizeof media / sizeof media[0]);
        raw_str(b, media[m].s, media[m].n);
    }
}

static void raw_hash(raw_buf *b, bool deviate)
{
    uint32_t k = km_rng_below(b->r, 12);
    if (deviate && k == 0) { /* bytes, 0 and over 64 bytes included */
        uint32_t n = km_rng_below(b->r, 70);
        raw_byte(b, 0xc4);
        raw_byte(b, n);
        for (uint32_t i = 0; i < n; i++)
            raw_byte(b, (unsigned)km_rng_next(b->r));
    } else if (deviate && k == 1) {
        raw_junk(b);
    } else if (k < 2) {
        raw_int(b, -(int64_t)km_rng_below(b->r, 1000) - 1);
    } else if (k < 3) {
        raw_uint(b, km_rng_below(b->r, 100));
    } else {
        raw_uint(b, km_rng_next(b->r));
    }
}

static void raw_optional_int(raw_buf *b, bool deviate)
{
    if (deviate)
        raw_junk(b);
    else if (km_rng_below(b->r, 2))
        raw_byte(b, 0xc0);
    else
        raw_int(b, raw_edge_int(b->r));
}

static void raw_optional_str(raw_buf *b, bool deviate)
{
    if (deviate)
        raw_junk(b);
    else if (km_rng_below(b->r, 3))
        raw_byte(b, 0xc0);
    else if (km_rng_below(b->r, 2))
        raw_str(b, "a", 1);
    else
        raw_str(b, "lora", 4);
}

/* One positional event (now and then a map, an unknown type or not an event at all); with
 * `deviate`, a field now and then takes a value the format does not allow there. */
static void raw_event(raw_buf *b, bool deviate)
{
    km_rng *r = b->r;
    uint32_t kind = km_rng_below(r, 24);
    if (kind == 0) {
        uint32_t extra = km_rng_below(r, 3) == 0;
        raw_array(b, 1 + extra);
        raw_str(b, "AllBlocksCleared", 16);
        if (extra)
            raw_junk(b);
        return;
    }
    if (kind == 1) {
        const char *type = km_rng_below(r, 2) ? "BlockMoved" : "blockstored";
        uint32_t extra = km_rng_below(r, 3);
        raw_array(b, 1 + extra);
        raw_str(b, type, strlen(type));
        for (uint32_t i = 0; i < extra; i++)
            raw_junk(b);
        return;
    }
    if (kind == 2) {
        raw_byte(b, 0x81);
        raw_str(b, "type", 4);
        raw_str(b, "AllBlocksCleared", 16);
        return;
    }
    if (kind == 3) {
        raw_byte(b, 0xc0);
        return;
    }
    bool stored = kind < 16;
    uint32_t n_blocks = km_rng_below(r, 20) == 0 ? 17 + km_rng_below(r, 3) : km_rng_below(r, 5);
    uint32_t block_size = km_rng_below(r, 15) == 0 ? 0 : 1 + km_rng_below(r, 4);
    uint32_t n_fields = !stored                   ? km_rng_below(r, 5)
                        : km_rng_below(r, 6) == 0 ? km_rng_below(r, 14)
                                                  : 4 + km_rng_below(r, 8);
    raw_array(b, 1 + n_fields);
    if (stored)
        raw_str(b, "BlockStored", 11);
    else
        raw_str(b, "BlockRemoved", 12);
    for (uint32_t f = 0; f < n_fields; f++) {
        bool d = deviate && km_rng_below(r, 25) == 0;
        if (f == 0) {
            if (d && km_rng_below(r, 2)) {
                raw_junk(b);
                continue;
            }
            raw_array(b, n_blocks);
            for (uint32_t i = 0; i < n_blocks; i++)
                raw_hash(b, d);
        } else if (!stored) {
            if (f == 1)
                raw_medium(b, d);
            else
                raw_optional_int(b, d);
        } else if (f == 1) {
            if (km_rng_below(r, 3) == 0 || block_size == 0)
                raw_byte(b, 0xc0);
            else
                raw_hash(b, d);
        } else if (f == 2) {
            if (d && km_rng_below(r, 3) == 0) {
                raw_junk(b);
                continue;
            }
            uint32_t n = n_blocks * block_size;
            if (d)
                n += km_rng_below(r, 2) ? 1 : block_size;
            raw_array(b, n);
            for (uint32_t i = 0; i < n; i++) {
                uint32_t t = km_rng_below(r, 30);
                if (d && t == 0)
                    raw_int(b, -1);
                else if (d && t == 1)
                    raw_uint(b, (uint64_t)UINT32_MAX + 1);
                else if (t < 3)
                    raw_uint(b, UINT32_MAX);
                else
                    raw_uint(b, km_rng_below(r, t < 15 ? 300 : 70000));
            }
        } else if (f == 3) {
            if (d && km_rng_below(r, 2))
                raw_int(b, raw_edge_int(r));
            else if (d)
                raw_junk(b);
            else
                raw_uint(b, block_size);
        } else if (f == 5) {
            raw_medium(b, d);
        } else if (f == 6 || f == 9) { /* lora_name, kv_cache_spec_kind */
            raw_optional_str(b, d);
        } else if (f == 7) { /* extra_keys */
            if (d) {
                raw_junk(b);
            } else if (km_rng_below(r, 4)) {
                raw_byte(b, 0xc0);
            } else {
                raw_array(b, n_blocks);
                for (uint32_t i = 0; i < n_blocks; i++)
                    raw_byte(b, 0xc0);
            }
        } else if (f <= 10) { /* lora_id, group_idx, kv_cache_spec_sliding_window */
            raw_optional_int(b, d);
        } else {
            raw_junk(b); /* past the positional schema */
        }
    }
}

/* One payload: mostly a well-formed batch, else one with wrong values, cut short, with trailing
 * bytes or with a byte changed. */
static void raw_payload(raw_buf *b)
{
    km_rng *r = b->r;
    b->size = 0;
    bool deviate = km_rng_below(r, 3) == 0;
    uint32_t items = km_rng_below(r, 10) == 0 ? km_rng_below(r, 6) : km_rng_below(r, 3) ? 3 : 2;
    raw_array(b, items);
    for (uint32_t i = 0; i < items; i++) {
        if (i == 0) {
            uint32_t k = km_rng_below(r, 6);
            if (k == 0)
                raw_byte(b, 0xcb), raw_be(b, UINT64_C(0x41d954fc40000000), 8);
            else if (k == 1)
                raw_byte(b, 0xca), raw_be(b, 0x3fa00000u, 4); /* float 32: 1.25 */
            else if (k == 2)
                raw_byte(b, 0xcb), raw_be(b, UINT64_C(0x7ff8000000000001), 8); /* a NaN */
            else if (k == 3)
                raw_int(b, raw_edge_int(r));
            else if (k == 4 && deviate)
                raw_junk(b);
            else
                raw_byte(b, 0xcb), raw_be(b, UINT64_C(0x41d954fc40000000), 8);
        } else if (i == 1) {
            if (deviate && km_rng_below(r, 20) == 0) {
                raw_junk(b);
                continue;
            }
            uint32_t n = km_rng_below(r, 30) == 0 ? 16 + km_rng_below(r, 4) : km_rng_below(r, 6);
            raw_array(b, n);
            for (uint32_t e = 0; e < n; e++)
                raw_event(b, deviate);
        } else if (i == 2) {
            if (deviate)
                raw_junk(b);
            else if (km_rng_below(r, 2))
                raw_byte(b, 0xc0);
            else
                raw_uint(b, km_rng_below(r, 8));
        } else {
            raw_junk(b);
        }
    }
    uint32_t m = km_rng_below(r, 30);
    if (m == 0 && b->size > 1)
        b->size = km_rng_below(r, (uint32_t)b->size);
    else if (m == 1)
        raw_byte(b, 0xc0);
    else if (m == 2 && b->size > 2)
        b->data[km_rng_below(r, (uint32_t)b->size)] = (unsigned char)km_rng_next(r);
    else if (m == 3 && b->size > 2)
        b->data[km_rng_below(r, (uint32_t)b->size)] ^= (unsigned char)(1u << km_rng_below(r, 8));
}

/* Payloads in every encoding a publisher may pick, well-formed and not, under the default limits
 * and under limits the payloads reach at their edges (hashes, tokens, events, string bytes,
 * values, payload bytes): the direct path and the tree path give the same batch, or the same
 * refusal with the same message, on every one. */
Test(kv_events, direct_path_agrees_with_the_tree_path_on_every_encoding_and_limit, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xe4c0d1u);
    enum { CONFIGS = 4 };
    km_kv_decoder_config cfg[CONFIGS];
    for (int k = 0; k < CONFIGS; k++)
        km_kv_decoder_config_init(&cfg[k]);
    cfg[1].max_hashes_per_event = 3;
    cfg[1].max_tokens_per_event = 8;
    cfg[1].max_events_per_batch = 4;
    cfg[1].max_string_bytes = 4;
    cfg[1].max_payload_objects = 120;
    cfg[2].max_payload_objects = 60;
    cfg[2].max_payload_bytes = 200;
    cfg[3].max_hashes_per_event = 17;
    cfg[3].max_tokens_per_event = 17;
    cfg[3].max_events_per_batch = 16;
    km_kv_decoder *direct[CONFIGS], *tree[CONFIGS];
    for (int k = 0; k < CONFIGS; k++) {
        direct[k] = new_decoder(&cfg[k]);
        tree[k] = new_decoder(&cfg[k]);
        km_kv_decoder_set_direct_path(tree[k], false);
    }
    static raw_buf b;
    b.r = &r;
    uint32_t accepted = 0, refused = 0;
    uint64_t placeholders = 0;
    double deadline = now_seconds() + 60;
    for (int iter = 0; iter < 25000 && now_seconds() < deadline; iter++) {
        raw_payload(&b);
        for (int k = 0; k < CONFIGS; k++) {
            km_kv_batch x, y;
            int rx = decode_bytes(direct[k], b.data, b.size, &x);
            int ry = decode_bytes(tree[k], b.data, b.size, &y);
            KM_CHECK(rx == ry, "iteration %d, limits %d: direct %s (%s), tree %s (%s)", iter, k,
                     km_error_name(rx), km_kv_decoder_last_error(direct[k]), km_error_name(ry),
                     km_kv_decoder_last_error(tree[k]));
            if (rx == KM_OK) {
                expect_same_batch(&x, &y);
                for (uint32_t i = 0; i < x.n_events; i++)
                    placeholders += x.events[i].placeholder;
                accepted++;
            } else {
                KM_CHECK(strcmp(km_kv_decoder_last_error(direct[k]),
                                km_kv_decoder_last_error(tree[k])) == 0,
                         "iteration %d, limits %d: \"%s\" against \"%s\"", iter, k,
                         km_kv_decoder_last_error(direct[k]), km_kv_decoder_last_error(tree[k]));
                refused++;
            }
        }
    }
    for (int k = 0; k < CONFIGS; k++) {
        km_kv_decoder_stats sx, sy;
        km_kv_decoder_get_stats(direct[k], &sx);
        km_kv_decoder_get_stats(tree[k], &sy);
        KM_CHECK(memcmp(&sx, &sy, offsetof(km_kv_decoder_stats, retained_bytes)) == 0,
                 "limits %d: decoder counters differ", k);
    }
    KM_CHECK(accepted > 5000 && refused > 5000 && placeholders > 100,
             "%u payloads decoded, %u refused, %llu placeholders: the generator drifted",
             accepted, refused, (unsigned long long)placeholders);
    KM_CHECK(km_kv_decoder_direct_decoded(direct[0]) > accepted / 8,
             "the direct path decoded %llu of %u payloads",
             (unsigned long long)km_kv_decoder_direct_decoded(direct[0]), accepted);
    for (int k = 0; k < CONFIGS; k++) {
        km_kv_decoder_destroy(direct[k]);
        km_kv_decoder_destroy(tree[k]);
    }
}

/* A token id as an engine step packs it, mostly a uint 16, with the other forms (and now and then
 * one the decoder must refuse) in runs of their own. */
static void pack_run_token(msgpack_packer *pk, km_rng *r, uint32_t form)
{
    switch (form) {
    case 0: msgpack_pack_uint32(pk, 256 + km_rng_below(r, 65280)); break; /* uint 16 */
    case 1: msgpack_pack_uint32(pk, km_rng_below(r, 128)); break; /* positive fixint */
    case 2: msgpack_pack_uint32(pk, 128 + km_rng_below(r, 128)); break; /* uint 8 */
    case 3: msgpack_pack_uint32(pk, 65536 + km_rng_below(r, 200000)); break; /* uint 32 */
    case 4: msgpack_pack_fix_uint64(pk, km_rng_below(r, 70000)); break;
    case 5: msgpack_pack_fix_int16(pk, (int16_t)km_rng_below(r, 30000)); break;
    case 6: msgpack_pack_int64(pk, -1 - (int64_t)km_rng_below(r, 5)); break; /* refused */
    default: msgpack_pack_uint64(pk, UINT64_C(1) << 32 | km_rng_below(r, 9)); break; /* too big */
    }
}

/* An engine hash: mostly a uint 64, sometimes a smaller or a signed form. */
static void pack_run_hash(msgpack_packer *pk, km_rng *r, uint32_t form)
{
    if (form < 6)
        msgpack_pack_uint64(pk, km_rng_next(r) | UINT64_C(1) << 63);
    else if (form == 6)
        msgpack_pack_uint64(pk, km_rng_below(r, 100000));
    else
        msgpack_pack_int64(pk, -(int64_t)km_rng_below(r, 1000) - 1);
}

/* Engine-step payloads with long hash and token arrays, their encodings mixed in runs, whole or
 * cut anywhere, under a payload object limit the runs reach now and then: the direct path's run
 * loops must agree with the tree path on every one. */
Test(kv_events, direct_path_runs_decode_exactly_as_the_tree_path, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x7a11u);
    km_kv_decoder_config cfg;
    km_kv_decoder_config_init(&cfg);
    km_kv_decoder_config small = cfg;
    small.max_payload_objects = 600;
    km_kv_decoder *direct[2] = {new_decoder(&cfg), new_decoder(&small)};
    km_kv_decoder *tree[2] = {new_decoder(&cfg), new_decoder(&small)};
    for (int k = 0; k < 2; k++)
        km_kv_decoder_set_direct_path(tree[k], false);
    uint32_t accepted = 0, refused = 0;
    for (int iter = 0; iter < 6000; iter++) {
        /* The direct path with and without its SSSE3 token reads (where the CPU has them). */
        for (int k = 0; k < 2; k++)
            km_kv_decoder_set_wide_token_reads(direct[k], iter % 2 == 0);
        pk_buf b;
        msgpack_packer *pk = pk_begin(&b);
        uint32_t n_events = 1 + km_rng_below(&r, 4);
        /* Mostly clean payloads; in the others each run may take a rarer form. */
        uint32_t rare = km_rng_below(&r, 3) == 0 ? 8 : km_rng_below(&r, 2) ? 6 : 1;
        msgpack_pack_array(pk, 3);
        msgpack_pack_double(pk, 1.7e9);
        msgpack_pack_array(pk, n_events);
        for (uint32_t e = 0; e < n_events; e++) {
            bool stored = km_rng_below(&r, 3) != 0;
            uint32_t n_blocks = km_rng_below(&r, 24);
            uint32_t block_size = 1 + km_rng_below(&r, 16);
            msgpack_pack_array(pk, stored ? 6 : 2);
            pack_cstr(pk, stored ? "BlockStored" : "BlockRemoved");
            msgpack_pack_array(pk, n_blocks);
            for (uint32_t i = 0; i < n_blocks; i++)
                pack_run_hash(pk, &r, km_rng_below(&r, rare == 1 ? 6 : rare));
            if (!stored)
                continue;
            if (km_rng_below(&r, 4) == 0)
                msgpack_pack_nil(pk);
            else
                pack_run_hash(pk, &r, km_rng_below(&r, rare == 1 ? 6 : rare));
            uint32_t n_tokens = n_blocks * block_size;
            msgpack_pack_array(pk, n_tokens);
            for (uint32_t i = 0; i < n_tokens;) {
                uint32_t form = km_rng_below(&r, 4) ? 0 : km_rng_below(&r, rare);
                uint32_t run = 1 + km_rng_below(&r, form ? 6 : 40);
                for (; run && i < n_tokens; run--, i++)
                    pack_run_token(pk, &r, form);
            }
            msgpack_pack_uint32(pk, block_size);
            msgpack_pack_nil(pk);
        }
        msgpack_pack_int64(pk, 0);
        size_t size = b.sb.size;
        if (km_rng_below(&r, 4) == 0 && size > 1)
            size = size - 1 - km_rng_below(&r, (uint32_t)(size < 40 ? size - 1 : 40)); /* cut */
        for (int k = 0; k < 2; k++) {
            km_kv_batch x, y;
            int rx = decode_bytes(direct[k], b.sb.data, size, &x);
            int ry = decode_bytes(tree[k], b.sb.data, size, &y);
            KM_CHECK(rx == ry, "iteration %d: direct %s, tree %s (%s)", iter, km_error_name(rx),
                     km_error_name(ry), km_kv_decoder_last_error(tree[k]));
            if (rx == KM_OK) {
                expect_same_batch(&x, &y);
                accepted++;
            } else {
                KM_CHECK(strcmp(km_kv_decoder_last_error(direct[k]),
                                km_kv_decoder_last_error(tree[k])) == 0,
                         "iteration %d: messages differ", iter);
                refused++;
            }
        }
        pk_end(&b);
    }
    for (int k = 0; k < 2; k++) {
        km_kv_decoder_stats sx, sy;
        km_kv_decoder_get_stats(direct[k], &sx);
        km_kv_decoder_get_stats(tree[k], &sy);
        KM_CHECK(memcmp(&sx, &sy, offsetof(km_kv_decoder_stats, retained_bytes)) == 0,
                 "decoder counters differ");
    }
    KM_CHECK(accepted > 3000 && refused > 1000, "%u payloads decoded, %u refused: the generator "
             "drifted", accepted, refused);
    KM_CHECK(km_kv_decoder_direct_decoded(direct[0]) > accepted / 4,
             "the direct path decoded %llu of %u payloads",
             (unsigned long long)km_kv_decoder_direct_decoded(direct[0]), accepted);
    for (int k = 0; k < 2; k++) {
        km_kv_decoder_destroy(direct[k]);
        km_kv_decoder_destroy(tree[k]);
    }
}
