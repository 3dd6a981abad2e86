/* SPDX-License-Identifier: Apache-2.0 */
/* Snapshots (km_index_save / km_index_load): a random workload is saved and loaded into a fresh
 * index, which must then equal the oracle in everything observable, and keep equalling it while
 * both receive more random updates (the rebuilt anchor lists must invalidate segment keys as the
 * originals did). Bad files: every truncation length class, flipped bytes all over the file, a
 * different format version or configuration, a missing file: each gets its own error code, and
 * the index it was loaded into keeps its content. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "index/host_table.h"
#include "test_util.h"

typedef struct fixture {
    km_rng r;
    km_oracle o;
    km_corpus corpus;
    km_workload wl;
    km_request_set rs;
    km_match_results res;
    char dir[64];
    char path[128];
} fixture;

static km_index *make_index(uint32_t max_workers, uint32_t S)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = max_workers;
    cfg.segment_blocks = S;
    cfg.threads = 2;
    cfg.initial_blocks = 256;
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    cr_assert_eq(rc, KM_OK, "km_index_create: %s", km_error_name(rc));
    return index;
}

/* Drive `steps` random batches into the index and the oracle. */
static void run_steps(fixture *f, km_index *index, int steps)
{
    for (int step = 0; step < steps; step++) {
        km_workload_step(&f->wl, &f->r, &f->o, 6);
        int rc = km_index_apply(index, f->wl.updates, f->wl.n_updates, NULL);
        KM_CHECK(rc == KM_OK, "apply: %s (%s)", km_error_name(rc), km_index_last_error(index));
        km_update_stats expect;
        km_oracle_apply(&f->o, f->wl.updates, f->wl.n_updates, &expect);
    }
}

static void check(fixture *f, km_index *index, uint32_t S, const char *when)
{
    char why[512];
    km_request_set_generate(&f->rs, &f->r, &f->corpus, 1500);
    KM_CHECK(km_check_index(&f->o, index, S, f->rs.requests, f->rs.n, &f->res, why, sizeof why),
             "%s: %s", when, why);
}

static void fixture_init(fixture *f, uint32_t W, uint64_t salt)
{
    memset(f, 0, sizeof *f);
    km_rng_init(&f->r, km_test_seed() ^ salt);
    km_oracle_init(&f->o, W);
    km_corpus_generate(&f->corpus, &f->r, 120, 4, 150);
    km_workload_init(&f->wl, &f->corpus, W);
    km_match_results_init(&f->res);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvmatch-snapshot-XXXXXX");
    cr_assert(mkdtemp(f->dir) != NULL);
    snprintf(f->path, sizeof f->path, "%s/index.snap", f->dir);
}

static void fixture_free(fixture *f)
{
    unlink(f->path);
    rmdir(f->dir);
    km_match_results_free(&f->res);
    km_request_set_free(&f->rs);
    km_workload_free(&f->wl);
    km_corpus_free(&f->corpus);
    km_oracle_free(&f->o);
}

static void round_trip(uint32_t W, uint32_t S)
{
    fixture f;
    fixture_init(&f, W, ((uint64_t)W << 8) ^ S);
    km_index *a = make_index(W, S);
    run_steps(&f, a, 40);
    check(&f, a, S, "before save");
    const char user[] = "stream positions: worker 3 seq 41";
    int rc = km_index_save(a, f.path, user, sizeof user);
    cr_assert_eq(rc, KM_OK, "save: %s (%s)", km_error_name(rc), km_index_last_error(a));

    km_index *b = make_index(W, S);
    void *got = NULL;
    size_t got_size = 0;
    rc = km_index_load(b, f.path, &got, &got_size);
    cr_assert_eq(rc, KM_OK, "load: %s (%s)", km_error_name(rc), km_index_last_error(b));
    cr_assert_eq(got_size, sizeof user);
    cr_assert(got && memcmp(got, user, sizeof user) == 0, "user section round trip");
    free(got);
    check(&f, b, S, "after load");
    km_index_stats sa, sb;
    km_index_get_stats(a, &sa);
    km_index_get_stats(b, &sb);
    cr_assert_eq(sa.segment_keys, sb.segment_keys, "segment keys survive");
    cr_assert_eq(sa.segment_pairs, sb.segment_pairs);

    /* The loaded index keeps working: more updates (removes must find segment keys through the
     * rebuilt anchors), compared with the oracle, and scoring identical to the original's. */
    for (int step = 0; step < 30; step++) {
        km_workload_step(&f.wl, &f.r, &f.o, 6);
        cr_assert_eq(km_index_apply(a, f.wl.updates, f.wl.n_updates, NULL), KM_OK);
        cr_assert_eq(km_index_apply(b, f.wl.updates, f.wl.n_updates, NULL), KM_OK);
        km_update_stats expect;
        km_oracle_apply(&f.o, f.wl.updates, f.wl.n_updates, &expect);
    }
    check(&f, b, S, "after more updates");
    km_match_results ra;
    km_match_results_init(&ra);
    cr_assert_eq(km_index_match_batch(a, f.rs.requests, f.rs.n, &ra), KM_OK);
    cr_assert_eq(km_index_match_batch(b, f.rs.requests, f.rs.n, &f.res), KM_OK);
    char why[256];
    cr_assert(km_results_identical(&ra, &f.res, why, sizeof why), "original vs loaded: %s", why);
    km_index_get_stats(a, &sa);
    km_index_get_stats(b, &sb);
    cr_assert_eq(sa.segment_pairs, sb.segment_pairs, "segment keys evolve identically");
    km_match_results_free(&ra);
    km_index_destroy(a);
    km_index_destroy(b);
    fixture_free(&f);
}

Test(snapshot, round_trip_segments_32, .timeout = 60) { round_trip(8, 32); }
Test(snapshot, round_trip_segments_4, .timeout = 60) { round_trip(8, 4); }
Test(snapshot, round_trip_no_segments_1024_workers, .timeout = 60) { round_trip(1024, 0); }

/* ---- bad files ------------------------------------------------------------------------------ */

static uint8_t *read_file(const char *path, size_t *size)
{
    FILE *fp = fopen(path, "rb");
    cr_assert(fp != NULL);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n);
    cr_assert(buf && fread(buf, 1, (size_t)n, fp) == (size_t)n);
    fclose(fp);
    *size = (size_t)n;
    return buf;
}

static void write_file(const char *path, const uint8_t *buf, size_t size)
{
    FILE *fp = fopen(path, "wb");
    cr_assert(fp != NULL);
    cr_assert_eq(fwrite(buf, 1, size, fp), size);
    fclose(fp);
}

/* Load `path` into an index that holds the fixture's state; expect `status` and no change. */
static void expect_rejected(fixture *f, km_index *index, uint32_t S, const char *path, int status,
                            const char *what)
{
    void *user = (void *)1;
    size_t user_size = 7;
    int rc = km_index_load(index, path, &user, &user_size);
    KM_CHECK(rc == status, "%s: load gave %s, expected %s (%s)", what, km_error_name(rc),
             km_error_name(status), km_index_last_error(index));
    KM_CHECK(user == NULL && user_size == 0, "%s: user outputs not cleared", what);
    KM_CHECK(km_index_last_error(index)[0] != '\0', "%s: no error detail", what);
    check(f, index, S, what);
}

Test(snapshot, bad_files_are_rejected_and_change_nothing, .timeout = 120)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 77);
    km_index *a = make_index(W, S);
    run_steps(&f, a, 25);
    cr_assert_eq(km_index_save(a, f.path, "u", 1), KM_OK);
    size_t size;
    uint8_t *good = read_file(f.path, &size);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/bad.snap", f.dir);

    /* Truncations: inside the header, at every section boundary region, one byte short. */
    size_t cuts[] = {0, 1, 31, 63, 64, 65, 100, size / 3, size / 2, size - 9, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        write_file(bad, good, cuts[i]);
        expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "truncated");
    }
    /* One extra byte. */
    uint8_t *longer = malloc(size + 1);
    memcpy(longer, good, size);
    longer[size] = 0;
    write_file(bad, longer, size + 1);
    expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "extended");
    free(longer);

    /* Flipped bits all over the file (header fields, tables, counters, user section). */
    uint8_t *flip = malloc(size);
    for (int k = 0; k < 40; k++) {
        memcpy(flip, good, size);
        size_t at = k < 8 ? (size_t)k * 8 + 3 : (size_t)km_rng_below(&f.r, (uint32_t)size);
        flip[at] ^= (uint8_t)(1u << km_rng_below(&f.r, 8));
        write_file(bad, flip, size);
        void *user = NULL;
        size_t user_size = 0;
        int rc = km_index_load(a, bad, &user, &user_size);
        KM_CHECK(rc == KM_ERR_CORRUPT || rc == KM_ERR_INCOMPATIBLE,
                 "flip at %zu: %s", at, km_error_name(rc));
        check(&f, a, S, "after flipped byte");
    }
    free(flip);

    /* Older format versions, with a correctly resealed header: incompatible, not corrupt, and the
     * message names both versions. 1: before storage tiers; 3: 24-byte block metadata; 4: 12-byte
     * block metadata with the parent's chain hash (header field at offset 28). */
    uint8_t *v2 = malloc(size);
    const uint32_t old_versions[3][2] = {{1, 24}, {3, 24}, {4, 12}};
    for (int k = 0; k < 3; k++) {
        memcpy(v2, good, size);
        memcpy(v2 + 8, &old_versions[k][0], 4);
        memcpy(v2 + 28, &old_versions[k][1], 4);
        uint64_t header_hash = XXH3_64bits(v2, 56);
        memcpy(v2 + 56, &header_hash, 8);
        write_file(bad, v2, size);
        char said[80];
        snprintf(said, sizeof said, "format version %u (layout 16/%u); this build reads version 5",
                 old_versions[k][0], old_versions[k][1]);
        cr_assert_eq(km_index_load(a, bad, NULL, NULL), KM_ERR_INCOMPATIBLE);
        cr_assert(strstr(km_index_last_error(a), said), "message: %s", km_index_last_error(a));
        expect_rejected(&f, a, S, bad, KM_ERR_INCOMPATIBLE, "an older version");
    }
    free(v2);

    /* Same file, index with another configuration. */
    km_index *other = make_index(W, 8);
    int rc = km_index_load(other, f.path, NULL, NULL);
    cr_assert_eq(rc, KM_ERR_INCOMPATIBLE, "segment_blocks mismatch: %s", km_error_name(rc));
    km_index_destroy(other);
    other = make_index(16, S);
    cr_assert_eq(km_index_load(other, f.path, NULL, NULL), KM_ERR_INCOMPATIBLE, "max_workers");
    km_index_destroy(other);

    /* Not a snapshot at all, and a missing file. */
    write_file(bad, (const uint8_t *)"{\"not\": \"a snapshot\"}\n", 22);
    expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "json file");
    unlink(bad);
    expect_rejected(&f, a, S, bad, KM_ERR_IO, "missing file");

    /* The good file still loads after all that. */
    cr_assert_eq(km_index_load(a, f.path, NULL, NULL), KM_OK, "%s", km_index_last_error(a));
    check(&f, a, S, "good file");
    free(good);
    km_index_destroy(a);
    fixture_free(&f);
}

/* A path that names no regular file (a directory, a FIFO: a misconfigured restore path) cannot
 * be read as a snapshot: KM_ERR_IO, not a file judged corrupt, and a FIFO no writer opens is not
 * waited on; the index keeps its content. */
Test(snapshot, a_path_that_is_not_a_regular_file_is_an_io_error, .timeout = 20)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 91);
    km_index *a = make_index(W, S);
    run_steps(&f, a, 20);
    expect_rejected(&f, a, S, f.dir, KM_ERR_IO, "a directory");
    char fifo[160];
    snprintf(fifo, sizeof fifo, "%s/fifo.snap", f.dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    expect_rejected(&f, a, S, fifo, KM_ERR_IO, "a FIFO");
    unlink(fifo);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Reseal a snapshot edited in place: the payload checksum, then the header's own. */
static void reseal(uint8_t *buf, size_t size)
{
    uint64_t payload_hash = XXH3_64bits(buf + 64, size - 64);
    memcpy(buf + 40, &payload_hash, 8);
    uint64_t header_hash = XXH3_64bits(buf, 56);
    memcpy(buf + 56, &header_hash, 8);
}

/* An edited snapshot, resealed and written beside the good one, loads into a fresh index as
 * corrupt (the error containing `says` when given); the good file then loads into that index,
 * which is returned. */
static km_index *edited_refused_good_loads(const fixture *f, uint8_t *bytes, size_t size,
                                           uint32_t W, uint32_t S, const char *says)
{
    reseal(bytes, size);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/bad.snap", f->dir);
    write_file(bad, bytes, size);
    km_index *b = make_index(W, S);
    cr_assert_eq(km_index_load(b, bad, NULL, NULL), KM_ERR_CORRUPT, "%s", km_index_last_error(b));
    if (says)
        cr_assert(strstr(km_index_last_error(b), says), "%s", km_index_last_error(b));
    cr_assert_eq(km_index_load(b, f->path, NULL, NULL), KM_OK, "%s", km_index_last_error(b));
    return b;
}

/* A bitmap on the free list is all zero: the next holder set to take it ORs its holders in. A
 * file whose free bitmap has bits set, its checksums resealed, is corrupt: loaded, its bits would
 * become holders of the next block to take the bitmap, and removing two of them would unpack more
 * than an inline set holds. */
Test(snapshot, a_free_bitmap_with_bits_set_is_corrupt, .timeout = 30)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 5);
    km_index *a = make_index(W, S);
    uint64_t block = 0x123456789abcdefULL;
    for (uint32_t w = 0; w < 5; w++) /* a fifth holder: the set becomes a bitmap */
        cr_assert_eq(km_index_store(a, w, KM_NO_PARENT, &block, 1), KM_OK);
    for (uint32_t w = 0; w < 2; w++) /* three left: inline again, the bitmap on the free list */
        cr_assert_eq(km_index_remove(a, w, &block, 1), KM_OK);
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    size_t size;
    uint8_t *bytes = read_file(f.path, &size);
    /* The block table's section: its 16-byte head, then the table header (capacity at 0,
     * pool_high at 44), the slots (16 bytes each), the metadata (7 bytes each), the bitmaps. */
    uint64_t capacity;
    uint32_t pool_high;
    memcpy(&capacity, bytes + 64 + 16, 8);
    memcpy(&pool_high, bytes + 64 + 16 + 44, 4);
    cr_assert_eq(pool_high, 1, "one bitmap, on the free list");
    size_t bitmap = 64 + 16 + 56 + (size_t)capacity * (16 + 7);
    cr_assert(bitmap + 8 <= size);
    uint64_t word;
    memcpy(&word, bytes + bitmap, 8);
    cr_assert_eq(word, 0, "the free bitmap is where the layout says, and empty");
    bytes[bitmap] = 0xE0; /* workers 5, 6, 7 */
    km_index *b = edited_refused_good_loads(&f, bytes, size, W, S, NULL);
    uint32_t holders[8], n;
    cr_assert_eq(km_index_holders(b, block, holders, 8, &n), KM_OK);
    cr_assert_eq(n, 3);
    free(bytes);
    km_index_destroy(b);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Every worker of a segment key holds the key's last block. A file whose segment key names a
 * worker holding none of its blocks, its counts and checksums resealed, is corrupt: loaded, the
 * worker would be credited with the whole segment, and no clear would scan the key away. */
Test(snapshot, a_segment_key_of_a_worker_without_its_block_is_corrupt, .timeout = 30)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 6);
    km_index *a = make_index(W, S);
    uint64_t chain[8];
    for (int i = 0; i < 8; i++)
        chain[i] = 0x1000 + UINT64_C(0x77777777) * (uint64_t)(i + 1);
    cr_assert_eq(km_index_store(a, 1, KM_NO_PARENT, chain, 8), KM_OK); /* segment keys 3 and 7 */
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    size_t size;
    uint8_t *bytes = read_file(f.path, &size);
    /* The segment table's section follows the block table's: its table header (capacity at 0,
     * pairs at 24), then its 16-byte slots (key, then four 16-bit ids). */
    uint64_t blocks_bytes, capacity, pairs;
    memcpy(&blocks_bytes, bytes + 64 + 8, 8);
    size_t header = 64 + 16 + (size_t)blocks_bytes + 16, slots = header + 56;
    memcpy(&capacity, bytes + header, 8);
    int edited = 0;
    for (uint64_t i = 0; i < capacity && slots + (i + 1) * 16 <= size; i++) {
        uint64_t key;
        memcpy(&key, bytes + slots + i * 16, 8);
        if (key == chain[7]) {
            uint16_t two = 2; /* worker 1's set {1} becomes {1, 2} */
            memcpy(bytes + slots + i * 16 + 8 + 2, &two, 2);
            edited = 1;
        }
    }
    cr_assert(edited, "segment key 7 not found where the layout says");
    memcpy(&pairs, bytes + header + 24, 8);
    pairs++;
    memcpy(bytes + header + 24, &pairs, 8);
    km_index *b = edited_refused_good_loads(&f, bytes, size, W, S, "without its last block");
    free(bytes);
    km_index_destroy(b);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Free slots are all zero since incremental growth; files written before it have their ids at
 * 0xFFFF. Both load (nothing reads a free slot's ids); a free slot with ids of neither form is
 * corrupt even when the checksums agree. */
Test(snapshot, free_slots_of_either_form_load_and_mixed_ids_are_corrupt, .timeout = 60)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 91);
    km_index *a = make_index(W, S);
    run_steps(&f, a, 15);
    cr_assert_eq(km_index_save(a, f.path, "u", 1), KM_OK);
    size_t size;
    uint8_t *buf = read_file(f.path, &size);
    /* The block table comes first: the 64-byte header, a 16-byte section head, a 56-byte table
     * header whose first field is the capacity, then the slots. */
    uint64_t capacity;
    memcpy(&capacity, buf + 64 + 16, 8);
    uint8_t *slots = buf + 64 + 16 + 56;
    cr_assert(136 + capacity * 16 <= size);
    uint64_t free_slot = UINT64_MAX, rewritten = 0;
    for (uint64_t i = 0; i < capacity; i++) {
        uint64_t key;
        memcpy(&key, slots + i * 16, 8);
        if (key != 0)
            continue;
        uint8_t zero[8] = {0};
        cr_assert(memcmp(slots + i * 16 + 8, zero, 8) == 0, "free slot %llu is not all zero",
                  (unsigned long long)i);
        memset(slots + i * 16 + 8, 0xFF, 8); /* as the writer before incremental growth */
        rewritten++;
        free_slot = i;
    }
    cr_assert_gt(rewritten, 0);
    reseal(buf, size);
    char old_form[160];
    snprintf(old_form, sizeof old_form, "%s/old-form.snap", f.dir);
    write_file(old_form, buf, size);
    km_index *b = make_index(W, S);
    cr_assert_eq(km_index_load(b, old_form, NULL, NULL), KM_OK, "%s", km_index_last_error(b));
    check(&f, b, S, "free slots at 0xFFFF");
    km_index_destroy(b);

    uint16_t mixed[4] = {0, 0xFFFF, 0xFFFF, 0xFFFF};
    memcpy(slots + free_slot * 16 + 8, mixed, 8);
    reseal(buf, size);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/mixed.snap", f.dir);
    write_file(bad, buf, size);
    expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "a free slot with mixed ids");
    free(buf);
    km_index_destroy(a);
    fixture_free(&f);
}

Test(snapshot, save_is_atomic_and_reports_io_errors, .timeout = 60)
{
    fixture f;
    fixture_init(&f, 8, 5);
    km_index *a = make_index(8, 32);
    run_steps(&f, a, 10);
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    run_steps(&f, a, 10);
    /* Overwrite: the new content replaces the old, no temporary file is left behind. */
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    int entries = 0;
    char cmd[160];
    snprintf(cmd, sizeof cmd, "ls -A %s | wc -l", f.dir);
    FILE *p = popen(cmd, "r");
    cr_assert(p && fscanf(p, "%d", &entries) == 1);
    pclose(p);
    cr_assert_eq(entries, 1, "only the snapshot remains in the directory");
    km_index *b = make_index(8, 32);
    cr_assert_eq(km_index_load(b, f.path, NULL, NULL), KM_OK);
    check(&f, b, 32, "second save");
    /* A directory that does not exist: KM_ERR_IO with the path in the message; index intact. */
    int rc = km_index_save(a, "/nonexistent-kvmatch-dir/x.snap", NULL, 0);
    cr_assert_eq(rc, KM_ERR_IO);
    cr_assert(strstr(km_index_last_error(a), "nonexistent-kvmatch-dir") != NULL);
    cr_assert_eq(km_index_save(NULL, f.path, NULL, 0), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_load(a, NULL, NULL, NULL), KM_ERR_NULL_POINTER);
    check(&f, a, 32, "after failed save");
    km_index_destroy(a);
    km_index_destroy(b);
    fixture_free(&f);
}

/* A path too long to name the temporary file beside it is an I/O error, as index.h lists for
 * km_index_save (and as open() would find it), with nothing written and the index intact. */
Test(snapshot, a_path_too_long_to_save_is_an_io_error, .timeout = 30)
{
    fixture f;
    fixture_init(&f, 8, 6);
    km_index *a = make_index(8, 4);
    run_steps(&f, a, 10);
    char *path = malloc(4096);
    cr_assert_not_null(path);
    int n = snprintf(path, 4096, "%s/", f.dir);
    memset(path + n, 'x', 4090 - (size_t)n);
    path[4090] = '\0';
    int rc = km_index_save(a, path, NULL, 0);
    KM_CHECK(rc == KM_ERR_IO, "save gave %s (%s)", km_error_name(rc), km_index_last_error(a));
    KM_CHECK(km_index_last_error(a)[0] != '\0', "no error detail");
    cr_assert_eq(rmdir(f.dir), 0, "the directory stays empty");
    cr_assert_eq(mkdir(f.dir, 0700), 0);
    check(&f, a, 4, "after a failed save");
    free(path);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Worker w's counters (km_worker_stats, its block count first) in a snapshot file read into buf:
 * the worker section (kind 3) after the 64-byte header and the sections before it. */
static uint8_t *worker_counters(uint8_t *buf, size_t size, uint32_t w)
{
    size_t off = 64;
    for (;;) {
        uint32_t kind;
        uint64_t bytes;
        memcpy(&kind, buf + off, 4);
        memcpy(&bytes, buf + off + 8, 8);
        if (kind == 3)
            break;
        off += 16 + bytes;
        cr_assert(off < size);
    }
    return buf + off + 16 + (size_t)w * sizeof(km_worker_stats);
}

/* Found by fuzzing (tests/fuzz/fuzz_snapshot.c): a block table holding one key in two slots, both
 * reachable from its home slot and counted in the header, passed every check and loaded. Lookups
 * then found one copy and updates changed only it; with segment keys, rebuilding the anchors
 * linked the key twice and removing the block looped forever. Such a file is corrupt. */
Test(snapshot, duplicate_key_in_a_table_is_corrupt, .timeout = 30)
{
    const uint32_t W = 8, S = 0;
    fixture f;
    fixture_init(&f, W, 93);
    km_index *a = make_index(W, S);
    uint64_t chain[6] = {0x1001, 0x1002, 0x1003, 0x1004, 0x1005, 0x1006};
    cr_assert_eq(km_index_store(a, 1, KM_NO_PARENT, chain, 6), KM_OK);
    km_update_stats expect;
    km_oracle_apply(&f.o, &(km_update){KM_UPDATE_STORE, 1, KM_NO_PARENT, chain, 6, KM_TIER_DEVICE},
                    1, &expect);
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    size_t size;
    uint8_t *buf = read_file(f.path, &size);
    /* Block table: header, section head, table header (capacity, live, tombstones, pairs, ...),
     * then capacity slots and capacity metadata entries. */
    uint8_t *th = buf + 64 + 16;
    uint64_t capacity, live, pairs;
    memcpy(&capacity, th, 8);
    memcpy(&live, th + 8, 8);
    memcpy(&pairs, th + 24, 8);
    uint8_t *slots = th + 56, *meta = slots + capacity * 16;
    uint64_t at = UINT64_MAX;
    for (uint64_t i = 0; i < capacity && at == UINT64_MAX; i++) {
        uint64_t key, next;
        memcpy(&key, slots + i * 16, 8);
        memcpy(&next, slots + ((i + 1) & (capacity - 1)) * 16, 8);
        if (key > 1 && next == 0)
            at = i;
    }
    cr_assert(at != UINT64_MAX);
    uint64_t dup = (at + 1) & (capacity - 1);
    memcpy(slots + dup * 16, slots + at * 16, 16); /* the same key and holder, one slot later */
    memcpy(meta + dup * sizeof(km_block_meta), meta + at * sizeof(km_block_meta), sizeof(km_block_meta));
    live++, pairs++;
    memcpy(th + 8, &live, 8);
    memcpy(th + 24, &pairs, 8);
    /* Worker 1's block count must agree with the table's pairs: find the worker section. */
    uint64_t blocks;
    uint8_t *w1 = worker_counters(buf, size, 1);
    memcpy(&blocks, w1, 8);
    blocks++;
    memcpy(w1, &blocks, 8);
    reseal(buf, size);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/dup.snap", f.dir);
    write_file(bad, buf, size);
    expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "a key in two slots");
    unlink(bad);
    free(buf);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Per-worker block counts that add up to the table's pairs but not worker by worker are corrupt:
 * a clear trusts a worker's count of 0 to mean it holds nothing, and would leave its blocks. */
Test(snapshot, worker_block_counts_must_agree_worker_by_worker, .timeout = 30)
{
    const uint32_t W = 8, S = 0;
    fixture f;
    fixture_init(&f, W, 94);
    km_index *a = make_index(W, S);
    uint64_t chain[5] = {0x2001, 0x2002, 0x2003, 0x2004, 0x2005};
    cr_assert_eq(km_index_store(a, 1, KM_NO_PARENT, chain, 5), KM_OK);
    cr_assert_eq(km_index_store(a, 2, KM_NO_PARENT, chain, 2), KM_OK);
    km_update_stats expect;
    km_update ups[2] = {{KM_UPDATE_STORE, 1, KM_NO_PARENT, chain, 5, KM_TIER_DEVICE},
                        {KM_UPDATE_STORE, 2, KM_NO_PARENT, chain, 2, KM_TIER_DEVICE}};
    km_oracle_apply(&f.o, ups, 2, &expect);
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    size_t size;
    uint8_t *buf = read_file(f.path, &size);
    /* Worker 1 holds 5 and worker 2 holds 2: say 2 and 5 (the same sum). */
    uint8_t *w1 = worker_counters(buf, size, 1), *w2 = worker_counters(buf, size, 2);
    uint64_t b1, b2;
    memcpy(&b1, w1, 8);
    memcpy(&b2, w2, 8);
    cr_assert_eq(b1, 5);
    cr_assert_eq(b2, 2);
    memcpy(w1, &b2, 8);
    memcpy(w2, &b1, 8);
    reseal(buf, size);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/counts.snap", f.dir);
    write_file(bad, buf, size);
    cr_assert_eq(km_index_load(a, bad, NULL, NULL), KM_ERR_CORRUPT);
    cr_assert(strstr(km_index_last_error(a), "worker 1's block count (2)") != NULL, "%s",
              km_index_last_error(a));
    expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "block counts swapped between two workers");
    unlink(bad);
    free(buf);
    km_index_destroy(a);
    fixture_free(&f);
}

/* Found by fuzzing (tests/fuzz/fuzz_snapshot.c): block metadata was loaded unchecked. A block at a
 * known position whose segment anchor was 0 (a reserved key of the anchor map) loaded; removing it
 * then corrupted the map's node lists and the next removal looped forever. Block metadata now
 * names the anchor by a 24-bit tag that the map key is derived from, so every tag is a valid key:
 * a block inside a segment may name any tag (0 and 1 included), loads, and removes terminate with
 * the index consistent. A block at a segment start is its own anchor: any other tag is corrupt. An
 * offset past the segment (it indexes the segment fingerprints) is corrupt. */
Test(snapshot, block_metadata_anchor_tags_are_checked_or_harmless, .timeout = 30)
{
    const uint32_t W = 8, S = 4;
    fixture f;
    fixture_init(&f, W, 95);
    km_index *a = make_index(W, S);
    uint64_t chain[6] = {0x1001, 0x1002, 0x1003, 0x1004, 0x1005, 0x1006};
    cr_assert_eq(km_index_store(a, 1, KM_NO_PARENT, chain, 6), KM_OK);
    km_update_stats expect;
    km_oracle_apply(&f.o, &(km_update){KM_UPDATE_STORE, 1, KM_NO_PARENT, chain, 6, KM_TIER_DEVICE},
                    1, &expect);
    cr_assert_eq(km_index_save(a, f.path, NULL, 0), KM_OK);
    size_t size;
    uint8_t *good = read_file(f.path, &size), *buf = malloc(size);
    uint8_t *th = good + 64 + 16;
    uint64_t capacity;
    memcpy(&capacity, th, 8);
    /* Header, section head, table header; then capacity slots and capacity metadata entries
     * (a u32: anchor tag in bits 0-23, offset in the segment in bits 24-31; then the parent tag). */
    size_t slots = 64 + 16 + 56, meta = slots + capacity * sizeof(km_slot);
    char bad[160];
    snprintf(bad, sizeof bad, "%s/anchor.snap", f.dir);
    int rejected = 0, loaded = 0;
    for (uint64_t i = 0; i < capacity; i++) {
        uint64_t key;
        uint32_t placement;
        memcpy(&key, good + slots + i * sizeof(km_slot), 8);
        if (key <= 1)
            continue;
        memcpy(&placement, good + meta + i * sizeof(km_block_meta), 4);
        uint32_t offset = placement >> 24;
        cr_assert(offset < S, "every block of the chain has a known offset");
        /* An offset past the segment. */
        uint32_t past = (placement & 0xFFFFFFu) | S << 24;
        memcpy(buf, good, size);
        memcpy(buf + meta + i * sizeof(km_block_meta), &past, 4);
        reseal(buf, size);
        write_file(bad, buf, size);
        expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "an offset past the segment");
        for (uint32_t tag = 0; tag < 3; tag++) { /* both reserved map keys, and one more */
            uint32_t written = (tag == 2 ? km_anchor_tag(key) ^ 0x80u : tag) | offset << 24;
            memcpy(buf, good, size);
            memcpy(buf + meta + i * sizeof(km_block_meta), &written, 4);
            reseal(buf, size);
            write_file(bad, buf, size);
            if (offset == 0) {
                expect_rejected(&f, a, S, bad, KM_ERR_CORRUPT, "a segment start naming another anchor");
                rejected++;
                continue;
            }
            km_index *b = make_index(W, S);
            cr_assert_eq(km_index_load(b, bad, NULL, NULL), KM_OK, "%s", km_index_last_error(b));
            cr_assert_eq(km_index_remove(b, 1, chain, 6), KM_OK);
            for (int k = 0; k < 6; k++) {
                uint32_t n = 1;
                cr_assert_eq(km_index_holders(b, chain[k], NULL, 0, &n), KM_OK);
                cr_assert_eq(n, 0, "block %d still held after the remove", k);
            }
            km_index_stats st;
            km_index_get_stats(b, &st);
            cr_assert_eq(st.pairs, 0);
            cr_assert_eq(st.segment_pairs, 0, "the segment key left with its blocks");
            km_index_destroy(b);
            loaded++;
        }
    }
    cr_assert_eq(rejected, 2 * 3, "blocks 0 and 4 start segments");
    cr_assert_eq(loaded, 4 * 3);
    unlink(bad);
    free(buf);
    free(good);
    km_index_destroy(a);
    fixture_free(&f);
}
