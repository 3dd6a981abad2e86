/* SPDX-License-Identifier: Apache-2.0 */
/* Index snapshots: the host tables written raw (slots, block metadata, bitmap pools, per-worker
 * counters) plus an opaque caller section, behind a checksummed header. Raw arrays make a restart
 * a few large reads instead of millions of inserts; the anchor lists are rebuilt from the segment
 * table and the block metadata. Loading stages everything in fresh structures, validates it in
 * full, and only then swaps it in, so a bad file never changes the index.
 *
 * File layout (all integers little-endian; docs/ARCHITECTURE.md "Snapshots"):
 *   header, 64 bytes: magic "KVMSNAP1", u32 format version, u32 header size, u32 max_workers,
 *     u32 segment_blocks, u32 sizeof(km_slot), u32 sizeof(km_block_meta), u64 payload bytes,
 *     u64 XXH3-64 of the payload, u64 reserved, u64 XXH3-64 of the 56 bytes before it
 *   payload: sections, each { u32 kind, u32 reserved, u64 bytes, bytes }. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/zeroed_pages.h"
#include "index/index_internal.h"

#define SNAPSHOT_MAGIC "KVMSNAP1"
/* 2: lower storage tier tables (sections 5 and 6). 3: the segment table's fingerprints (S bytes per
 * slot) after its slots; no tombstones. 4: block metadata of anchor tag and offset in the segment
 * (parent chain hash beside it, 12 bytes); tables of any capacity (home slots by multiply-shift
 * range reduction, km_slot_home). 5: 7-byte block metadata (the parent kept as a 24-bit tag,
 * km_parent_tag). */
#define SNAPSHOT_VERSION 5u
#define SNAPSHOT_HEADER_BYTES 64u

enum snapshot_section {
    SECTION_BLOCKS = 1,   /* table header + slots + meta + pool + pool free list */
    SECTION_SEGMENTS = 2, /* table header + slots + fingerprints + pool + pool free list */
    SECTION_WORKERS = 3,  /* max_workers km_worker_stats */
    SECTION_USER = 4,     /* the caller's bytes */
    SECTION_LOWER_HOST = 5, /* table header + slots + pool + free list: pairs whose tier is host */
    SECTION_LOWER_DISK = 6, /* the same for disk */
};

/* Fixed part of a table section. */
typedef struct table_header {
    uint64_t capacity, live, tombstones, pairs, shared_sets;
    uint32_t words_per_set, pool_high, pool_free_count, has_meta;
} table_header;

typedef struct header_fields {
    char magic[8];
    uint32_t version, header_bytes, max_workers, segment_blocks, slot_bytes, meta_bytes;
    uint64_t payload_bytes, payload_hash, reserved, header_hash;
} header_fields;
_Static_assert(sizeof(header_fields) == SNAPSHOT_HEADER_BYTES, "snapshot header is 64 bytes");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots are written little-endian raw");

/* ---- writing ---------------------------------------------------------------------------------- */

typedef struct writer {
    int fd;
    XXH3_state_t *hash;
    uint64_t bytes;
    int error; /* errno of the first failure */
} writer;

static void put(writer *w, const void *data, size_t n)
{
    const char *p = data;
    XXH3_64bits_update(w->hash, data, n);
    w->bytes += n;
    while (n > 0 && !w->error) {
        ssize_t k = write(w->fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            w->error = k < 0 ? errno : EIO;
            return;
        }
        p += k;
        n -= (size_t)k;
    }
}

static void put_section(writer *w, uint32_t kind, uint64_t bytes)
{
    uint32_t head[2] = {kind, 0};
    put(w, head, sizeof head);
    put(w, &bytes, sizeof bytes);
}

static uint64_t table_section_bytes(const km_table *t)
{
    return sizeof(table_header) + t->capacity * sizeof(km_slot) +
           (t->meta ? t->capacity * sizeof(km_block_meta) : 0) + t->capacity * t->aux_bytes +
           (uint64_t)t->pool_high * t->words_per_set * sizeof(uint64_t) +
           (uint64_t)t->pool_free_count * sizeof(uint32_t);
}

static void put_table(writer *w, uint32_t kind, const km_table *t)
{
    put_section(w, kind, table_section_bytes(t));
    table_header h = {t->capacity,      t->live,          t->tombstones,      t->pairs,
                      t->shared_sets,   t->words_per_set, t->pool_high,       t->pool_free_count,
                      t->meta != NULL};
    put(w, &h, sizeof h);
    put(w, t->slots, t->capacity * sizeof(km_slot));
    if (t->meta)
        put(w, t->meta, t->capacity * sizeof(km_block_meta));
    if (t->aux_bytes)
        put(w, t->aux, t->capacity * t->aux_bytes);
    if (t->pool_high)
        put(w, t->pool, (size_t)t->pool_high * t->words_per_set * sizeof(uint64_t));
    if (t->pool_free_count)
        put(w, t->pool_free, t->pool_free_count * sizeof(uint32_t));
}

static void header_seal(header_fields *h)
{
    h->header_hash = XXH3_64bits(h, offsetof(header_fields, header_hash));
}

bool km_index_save_temp_path(const char *path, long pid, char *out, size_t size)
{
    int n = snprintf(out, size, "%s.tmp.%ld", path, pid);
    return n >= 0 && (size_t)n < size;
}

int km_index_save(km_index *index, const char *path, const void *user, size_t user_size)
{
    if (!index)
        return KM_ERR_NULL_POINTER;
    index->last_error[0] = '\0';
    if (!path || (!user && user_size > 0))
        return km_index_fail(index, KM_ERR_NULL_POINTER, "snapshot path or user section is NULL");
    char tmp[4096];
    if (!km_index_save_temp_path(path, (long)getpid(), tmp, sizeof tmp))
        return km_index_fail(index, KM_ERR_IO, "snapshot: cannot create a temporary file beside "
                             "%.64s...: %s", path, strerror(ENAMETOOLONG));
    writer w = {.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (w.fd < 0)
        return km_index_fail(index, KM_ERR_IO, "snapshot: cannot create %s: %s", tmp, strerror(errno));
    w.hash = XXH3_createState();
    if (!w.hash) {
        close(w.fd);
        unlink(tmp);
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: checksum state");
    }
    XXH3_64bits_reset(w.hash);
    header_fields h = {.version = SNAPSHOT_VERSION,
                       .header_bytes = SNAPSHOT_HEADER_BYTES,
                       .max_workers = index->config.max_workers,
                       .segment_blocks = index->config.segment_blocks,
                       .slot_bytes = sizeof(km_slot),
                       .meta_bytes = sizeof(km_block_meta)};
    memcpy(h.magic, SNAPSHOT_MAGIC, 8);
    /* Header placeholder first; the real one (with the checksums) is written over it at the end. */
    if (write(w.fd, &h, sizeof h) != (ssize_t)sizeof h)
        w.error = errno ? errno : EIO;
    /* A table is written as one array: finish any growth first. */
    km_table_finish_growth(&index->blocks);
    km_table_finish_growth(&index->segments);
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++)
        km_table_finish_growth(&index->lower[t]);
    put_table(&w, SECTION_BLOCKS, &index->blocks);
    put_table(&w, SECTION_SEGMENTS, &index->segments);
    put_table(&w, SECTION_LOWER_HOST, &index->lower[KM_TIER_HOST - 1]);
    put_table(&w, SECTION_LOWER_DISK, &index->lower[KM_TIER_DISK - 1]);
    put_section(&w, SECTION_WORKERS, (uint64_t)index->config.max_workers * sizeof(km_worker_stats));
    put(&w, index->workers, (size_t)index->config.max_workers * sizeof(km_worker_stats));
    put_section(&w, SECTION_USER, user_size);
    if (user_size)
        put(&w, user, user_size);
    h.payload_bytes = w.bytes;
    h.payload_hash = XXH3_64bits_digest(w.hash);
    XXH3_freeState(w.hash);
    header_seal(&h);
    if (!w.error && pwrite(w.fd, &h, sizeof h, 0) != (ssize_t)sizeof h)
        w.error = errno ? errno : EIO;
    if (!w.error && fsync(w.fd) != 0)
        w.error = errno;
    if (close(w.fd) != 0 && !w.error)
        w.error = errno;
    if (!w.error && rename(tmp, path) != 0)
        w.error = errno;
    if (w.error) {
        unlink(tmp);
        return km_index_fail(index, KM_ERR_IO, "snapshot: writing %s: %s", path, strerror(w.error));
    }
    /* Make the rename itself durable. */
    char dir_buf[4096];
    snprintf(dir_buf, sizeof dir_buf, "%s", path);
    int dir = open(dirname(dir_buf), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
        fsync(dir);
        close(dir);
    }
    return KM_OK;
}

/* ---- reading ---------------------------------------------------------------------------------- */

typedef struct reader {
    int fd;
    XXH3_state_t *hash;
    uint64_t left; /* payload bytes not read yet */
    km_index *index;
} reader;

static int take(reader *r, void *out, uint64_t n, const char *what)
{
    if (n > r->left)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot truncated or inconsistent: %s "
                             "needs %llu bytes, %llu left", what, (unsigned long long)n,
                             (unsigned long long)r->left);
    char *p = out;
    uint64_t todo = n;
    while (todo > 0) {
        size_t chunk = todo > (UINT64_C(1) << 30) ? (size_t)1 << 30 : (size_t)todo;
        ssize_t k = read(r->fd, p, chunk);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return km_index_fail(r->index, KM_ERR_IO, "snapshot: reading %s: %s", what, strerror(errno));
        if (k == 0)
            return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot truncated in %s", what);
        p += k;
        todo -= (uint64_t)k;
    }
    XXH3_64bits_update(r->hash, out, n);
    r->left -= n;
    return KM_OK;
}

static int take_section(reader *r, uint32_t expect_kind, uint64_t *bytes)
{
    uint32_t head[2];
    int rc = take(r, head, sizeof head, "section header");
    if (!rc)
        rc = take(r, bytes, sizeof *bytes, "section size");
    if (rc)
        return rc;
    if (head[0] != expect_kind)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot: section %u where %u was expected",
                             head[0], expect_kind);
    if (*bytes > r->left)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot: section %u claims %llu bytes, "
                             "%llu left", head[0], (unsigned long long)*bytes,
                             (unsigned long long)r->left);
    return KM_OK;
}

/* Check that a slot's worker set is well formed. */
static int slot_valid(const km_table *t, const km_slot *s, uint32_t max_workers, uint64_t *pairs,
                      uint8_t *pool_seen)
{
    if (km_slot_is_shared(s)) {
        uint32_t set = km_slot_pool_index(s);
        if (set >= t->pool_high || pool_seen[set])
            return 0;
        pool_seen[set] = 1;
        const uint64_t *bits = t->pool + (uint64_t)set * t->words_per_set;
        uint64_t count = 0;
        for (uint32_t w = 0; w < t->words_per_set; w++)
            count += (uint64_t)__builtin_popcountll(bits[w]);
        uint32_t tail = max_workers % 64;
        if (tail && (bits[t->words_per_set - 1] >> tail))
            return 0; /* a worker id past max_workers */
        if (count != s->ids[3] || count <= KM_SLOT_DEMOTE_AT)
            return 0;
        *pairs += count;
        return 1;
    }
    uint32_t n = 0;
    for (; n < KM_SLOT_INLINE && s->ids[n] != KM_SLOT_ID_EMPTY; n++)
        if (s->ids[n] >= max_workers || (n > 0 && s->ids[n] <= s->ids[n - 1]))
            return 0;
    for (uint32_t i = n; i < KM_SLOT_INLINE; i++)
        if (s->ids[i] != KM_SLOT_ID_EMPTY)
            return 0;
    if (n == 0)
        return 0; /* live keys always have a holder */
    *pairs += n;
    return 1;
}

/* Read one table section into t (fresh, accounted to memory) and validate it. */
static int take_table(reader *r, uint32_t kind, km_table *t, int with_meta, uint32_t aux_bytes,
                      km_memory *memory)
{
    const km_index *index = r->index;
    uint64_t bytes;
    int rc = take_section(r, kind, &bytes);
    if (rc)
        return rc;
    table_header h;
    rc = take(r, &h, sizeof h, "table header");
    if (rc)
        return rc;
    uint32_t words = (index->config.max_workers + 63u) / 64u;
    if (h.capacity < 64 || h.capacity > KM_TABLE_MAX_SLOTS ||
        h.words_per_set != words || h.has_meta != (uint32_t)with_meta ||
        h.pool_free_count > h.pool_high || h.live + h.tombstones >= h.capacity)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot: table %u header is inconsistent", kind);
    memset(t, 0, sizeof *t);
    t->memory = memory;
    t->words_per_set = words;
    uint64_t expect = sizeof h + h.capacity * sizeof(km_slot) +
                      (with_meta ? h.capacity * sizeof(km_block_meta) : 0) + h.capacity * aux_bytes +
                      (uint64_t)h.pool_high * words * sizeof(uint64_t) +
                      (uint64_t)h.pool_free_count * sizeof(uint32_t);
    if (expect != bytes)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot: table %u is %llu bytes, its "
                             "header implies %llu", kind, (unsigned long long)bytes,
                             (unsigned long long)expect);
    /* The arrays come from km_table_init so that growth and release work as for any table. */
    rc = km_table_init_capacity(t, h.capacity, index->config.max_workers, with_meta, aux_bytes,
                                memory);
    if (rc)
        return km_index_fail(r->index, rc, "snapshot: table %u of %llu slots: %s", kind,
                             (unsigned long long)h.capacity, km_strerror(rc));
    if (t->capacity != h.capacity)
        return km_index_fail(r->index, KM_ERR_INTERNAL, "snapshot: table sizing mismatch");
    rc = take(r, t->slots, h.capacity * sizeof(km_slot), "slots");
    if (!rc && with_meta)
        rc = take(r, t->meta, h.capacity * sizeof(km_block_meta), "block metadata");
    if (!rc && aux_bytes)
        rc = take(r, t->aux, h.capacity * aux_bytes, "segment fingerprints");
    if (rc)
        return rc;
    if (h.pool_high) {
        uint64_t pool_bytes = (uint64_t)h.pool_high * (words * sizeof(uint64_t) + sizeof(uint32_t));
        rc = km_memory_reserve(memory, 0, pool_bytes);
        if (rc)
            return km_index_fail(r->index, rc, "snapshot: bitmap pool of %u sets", h.pool_high);
        t->pool = km_pages_alloc((uint64_t)h.pool_high * words * sizeof(uint64_t));
        t->pool_free = malloc((size_t)h.pool_high * sizeof(uint32_t));
        t->pool_capacity = h.pool_high;
        if (!t->pool || !t->pool_free)
            return km_index_fail(r->index, KM_ERR_OUT_OF_MEMORY, "snapshot: bitmap pool");
        rc = take(r, t->pool, (uint64_t)h.pool_high * words * sizeof(uint64_t), "bitmap pool");
        if (!rc && h.pool_free_count)
            rc = take(r, t->pool_free, (uint64_t)h.pool_free_count * sizeof(uint32_t), "pool free list");
        if (rc)
            return rc;
    }
    t->pool_high = h.pool_high;
    t->pool_free_count = h.pool_free_count;

    /* Structure: counts, set encodings, bitmap ownership; what scoring relies on never to read
     * out of bounds. */
    uint8_t *pool_seen = calloc(h.pool_high ? h.pool_high : 1, 1);
    if (!pool_seen)
        return km_index_fail(r->index, KM_ERR_OUT_OF_MEMORY, "snapshot: validation");
    uint64_t live = 0, tombstones = 0, pairs = 0, shared = 0;
    int ok = 1;
    for (uint64_t i = 0; i < h.capacity && ok; i++) {
        const km_slot *s = &t->slots[i];
        if (s->key == KM_KEY_EMPTY || s->key == KM_KEY_TOMBSTONE) {
            tombstones += s->key == KM_KEY_TOMBSTONE;
            /* A free slot's ids are all zero, or all KM_SLOT_ID_EMPTY as files before incremental
             * growth wrote them (nothing reads them). */
            uint32_t zero = 0, unused = 0;
            for (uint32_t j = 0; j < KM_SLOT_INLINE; j++) {
                zero += s->ids[j] == 0;
                unused += s->ids[j] == KM_SLOT_ID_EMPTY;
            }
            ok &= zero == KM_SLOT_INLINE || unused == KM_SLOT_INLINE;
            for (uint32_t j = 0; j < aux_bytes; j++) /* a free slot's fingerprints are zero */
                ok &= km_table_aux(t, i)[j] == 0;
            continue;
        }
        live++;
        shared += km_slot_is_shared(s);
        ok &= slot_valid(t, s, index->config.max_workers, &pairs, pool_seen);
        if (with_meta) {
            /* An offset inside the segment (it indexes the segment fingerprints), and a block at
             * a segment start is its own segment's first block: its tag is its own. */
            const km_block_meta *m = &t->meta[i];
            uint32_t S = index->config.segment_blocks, offset = km_meta_offset(m);
            ok &= offset == KM_OFFSET_UNKNOWN || offset < (S ? S : 1);
            if (S && offset == 0)
                ok &= km_meta_anchor_tag(m) == km_anchor_tag(s->key);
        }
        /* Reachable from its home slot: no empty slot between home and here. And the only slot of
         * its key: a second copy would be reachable too, so one of the two lies on the other's
         * path (lookups would find one, updates change one, and the anchor rebuild would link the
         * key twice, which makes a later removal loop forever). */
        for (uint64_t j = km_slot_home(s->key, h.capacity); ok && j != i; j = km_slot_next(j, h.capacity))
            ok &= t->slots[j].key != KM_KEY_EMPTY && t->slots[j].key != s->key;
    }
    for (uint32_t k = 0; ok && k < h.pool_free_count; k++) {
        uint32_t set = t->pool_free[k];
        ok &= set < h.pool_high && !pool_seen[set];
        if (ok)
            pool_seen[set] = 2;
        /* A free bitmap is all zero: the next set to take it ORs its holders in. */
        const uint64_t *bits = ok ? t->pool + (uint64_t)set * t->words_per_set : NULL;
        for (uint32_t w = 0; ok && w < t->words_per_set; w++)
            ok &= bits[w] == 0;
    }
    for (uint32_t k = 0; ok && k < h.pool_high; k++)
        ok &= pool_seen[k] != 0; /* every bitmap is in use or free, never lost */
    free(pool_seen);
    if (!ok || live != h.live || tombstones != h.tombstones || pairs != h.pairs || shared != h.shared_sets)
        return km_index_fail(r->index, KM_ERR_CORRUPT, "snapshot: table %u content is inconsistent "
                             "with its header", kind);
    t->live = live;
    t->tombstones = tombstones;
    t->pairs = pairs;
    t->shared_sets = shared;
    /* Files written before backward-shift deletion may hold tombstones; erase needs none. */
    rc = km_table_purge_tombstones(t);
    if (rc)
        return km_index_fail(r->index, rc, "snapshot: purging the tombstones of table %u", kind);
    return KM_OK;
}

/* Every pair in a lower tier table must be held (in the block table), and in one tier only. */
/* Each worker's block count must be the pairs it holds in the block table: a clear trusts a
 * count of 0 to mean that the worker holds nothing (src/index/index.c, apply_clear). */
static int check_worker_blocks(km_index *index, const km_index *staged)
{
    uint32_t max_workers = staged->config.max_workers;
    uint32_t *workers = malloc(max_workers * sizeof *workers);
    uint64_t *held = calloc(max_workers, sizeof *held);
    int rc = workers && held
                 ? KM_OK
                 : km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: count check scratch");
    const km_table *bt = &staged->blocks;
    for (uint64_t s = 0; !rc && s < bt->capacity; s++) {
        if (bt->slots[s].key <= KM_KEY_TOMBSTONE)
            continue;
        uint32_t n = km_table_set_list(bt, s, workers, max_workers);
        for (uint32_t i = 0; i < n; i++)
            held[workers[i]]++;
    }
    for (uint32_t w = 0; !rc && w < max_workers; w++)
        if (held[w] != staged->workers[w].blocks)
            rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot: worker %u's block count (%llu) "
                               "disagrees with the table (%llu pairs)", w,
                               (unsigned long long)staged->workers[w].blocks,
                               (unsigned long long)held[w]);
    free(workers);
    free(held);
    return rc;
}

static int check_lower_tiers(km_index *index, const km_index *staged)
{
    uint32_t *workers = malloc(staged->config.max_workers * sizeof *workers);
    if (!workers)
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: tier check scratch");
    int rc = KM_OK;
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT && !rc; t++) {
        const km_table *lt = &staged->lower[t];
        for (uint64_t s = 0; s < lt->capacity && !rc; s++) {
            uint64_t key = lt->slots[s].key;
            if (key <= KM_KEY_TOMBSTONE)
                continue;
            uint64_t bs = km_table_find(&staged->blocks, key);
            uint32_t n = km_table_set_list(lt, s, workers, staged->config.max_workers);
            for (uint32_t i = 0; i < n && !rc; i++) {
                int other = 0;
                for (uint32_t u = 0; u + 1 < KM_TIER_COUNT; u++) {
                    uint64_t os = u == t ? KM_SLOT_NONE : km_table_find(&staged->lower[u], key);
                    other |= os != KM_SLOT_NONE && km_table_set_contains(&staged->lower[u], os, workers[i]);
                }
                if (bs == KM_SLOT_NONE || !km_table_set_contains(&staged->blocks, bs, workers[i]) || other)
                    rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot: a lower-tier pair (block "
                                       "%016llx, worker %u) is not held, or in two tiers",
                                       (unsigned long long)key, workers[i]);
            }
        }
    }
    free(workers);
    return rc;
}

/* Every worker of a segment key holds the key's last block (the block whose chain hash the key
 * is): a segment pair without it would credit the worker with the whole segment, and no clear
 * of a worker holding no block would ever scan it away. One lookup per segment key. */
static int check_segment_holders(km_index *index, const km_index *staged)
{
    const km_table *seg = &staged->segments;
    if (seg->capacity == 0)
        return KM_OK;
    uint32_t *workers = malloc(staged->config.max_workers * sizeof *workers);
    if (!workers)
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: segment check scratch");
    int rc = KM_OK;
    for (uint64_t s = 0; s < seg->capacity && !rc; s++) {
        uint64_t key = seg->slots[s].key;
        if (key <= KM_KEY_TOMBSTONE)
            continue;
        uint64_t bs = km_table_find(&staged->blocks, key);
        uint32_t n = km_table_set_list(seg, s, workers, staged->config.max_workers);
        for (uint32_t i = 0; i < n && !rc; i++)
            if (bs == KM_SLOT_NONE || !km_table_set_contains(&staged->blocks, bs, workers[i]))
                rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot: worker %u holds segment key "
                                   "%016llx without its last block", workers[i],
                                   (unsigned long long)key);
    }
    free(workers);
    return rc;
}

int km_index_load(km_index *index, const char *path, void **user_out, size_t *user_size_out)
{
    return km_index_load_checked(index, path, NULL, NULL, user_out, user_size_out);
}

int km_index_load_checked(km_index *index, const char *path, km_snapshot_check_fn check,
                          void *check_user, void **user_out, size_t *user_size_out)
{
    if (!index)
        return KM_ERR_NULL_POINTER;
    index->last_error[0] = '\0';
    if (user_out)
        *user_out = NULL;
    if (user_size_out)
        *user_size_out = 0;
    if (!path)
        return km_index_fail(index, KM_ERR_NULL_POINTER, "snapshot path is NULL");
    /* Non-blocking: opening a FIFO would otherwise wait for a writer. No effect on a file. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return km_index_fail(index, KM_ERR_IO, "snapshot: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    header_fields h;
    int rc = KM_OK;
    ssize_t got = 0;
    if (fstat(fd, &st) != 0)
        rc = km_index_fail(index, KM_ERR_IO, "snapshot %s: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = km_index_fail(index, KM_ERR_IO, "snapshot %s: not a regular file", path);
    else if ((got = read(fd, &h, sizeof h)) < 0)
        rc = km_index_fail(index, KM_ERR_IO, "snapshot %s: reading: %s", path, strerror(errno));
    else if (got != (ssize_t)sizeof h)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot %s: shorter than its header", path);
    else if (memcmp(h.magic, SNAPSHOT_MAGIC, 8) != 0)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "%s is not a kvmatch snapshot (bad magic)", path);
    else if (XXH3_64bits(&h, offsetof(header_fields, header_hash)) != h.header_hash)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot %s: header checksum mismatch", path);
    else if (h.version != SNAPSHOT_VERSION || h.header_bytes != SNAPSHOT_HEADER_BYTES ||
             h.slot_bytes != sizeof(km_slot) || h.meta_bytes != sizeof(km_block_meta))
        rc = km_index_fail(index, KM_ERR_INCOMPATIBLE, "snapshot %s: format version %u (layout "
                           "%u/%u); this build reads version %u", path, h.version, h.slot_bytes,
                           h.meta_bytes, SNAPSHOT_VERSION);
    else if (h.max_workers != index->config.max_workers ||
             h.segment_blocks != index->config.segment_blocks)
        rc = km_index_fail(index, KM_ERR_INCOMPATIBLE, "snapshot %s: written with max_workers %u, "
                           "segment_blocks %u; this index has %u, %u", path, h.max_workers,
                           h.segment_blocks, index->config.max_workers, index->config.segment_blocks);
    else if ((uint64_t)st.st_size != SNAPSHOT_HEADER_BYTES + h.payload_bytes)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot %s: %lld bytes, header says %llu "
                           "(truncated or extended)", path, (long long)st.st_size,
                           (unsigned long long)(SNAPSHOT_HEADER_BYTES + h.payload_bytes));
    if (rc) {
        close(fd);
        return rc;
    }

    /* Stage everything in a scratch index that shares only the configuration. */
    km_index staged;
    memset(&staged, 0, sizeof staged);
    staged.config = index->config;
    staged.memory.cap = index->memory.cap;
    staged.anchor_free_head = UINT32_MAX;
    km_u64map_init(&staged.anchors, &staged.memory);
    reader r = {.fd = fd, .hash = XXH3_createState(), .left = h.payload_bytes, .index = index};
    void *user = NULL;
    uint64_t user_size = 0;
    if (!r.hash)
        rc = km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: checksum state");
    else
        XXH3_64bits_reset(r.hash);
    if (!rc)
        rc = take_table(&r, SECTION_BLOCKS, &staged.blocks, 1, 0, &staged.memory);
    if (!rc)
        rc = take_table(&r, SECTION_SEGMENTS, &staged.segments, 0, staged.config.segment_blocks,
                            &staged.memory);
    if (!rc)
        rc = take_table(&r, SECTION_LOWER_HOST, &staged.lower[KM_TIER_HOST - 1], 0, 0, &staged.memory);
    if (!rc)
        rc = take_table(&r, SECTION_LOWER_DISK, &staged.lower[KM_TIER_DISK - 1], 0, 0, &staged.memory);
    if (!rc) {
        uint64_t bytes;
        uint64_t expect = (uint64_t)staged.config.max_workers * sizeof(km_worker_stats);
        rc = take_section(&r, SECTION_WORKERS, &bytes);
        if (!rc && bytes != expect)
            rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot: worker section size");
        if (!rc && !(staged.workers = malloc(expect)))
            rc = km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: worker counters");
        if (!rc)
            rc = take(&r, staged.workers, expect, "worker counters");
    }
    if (!rc)
        rc = take_section(&r, SECTION_USER, &user_size);
    if (!rc && user_size) {
        user = malloc(user_size);
        if (!user)
            rc = km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "snapshot: user section of %llu bytes",
                               (unsigned long long)user_size);
        else
            rc = take(&r, user, user_size, "user section");
    }
    if (!rc && r.left != 0)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot: %llu trailing bytes",
                           (unsigned long long)r.left);
    if (!rc && XXH3_64bits_digest(r.hash) != h.payload_hash)
        rc = km_index_fail(index, KM_ERR_CORRUPT, "snapshot %s: payload checksum mismatch", path);
    if (r.hash)
        XXH3_freeState(r.hash);
    close(fd);
    if (!rc) {
        rc = km_index_rebuild_anchors(&staged);
        if (rc)
            km_index_fail(index, rc, "snapshot: rebuilding segment anchors: %s",
                          rc == KM_ERR_CORRUPT ? "a segment key's last block is missing"
                                               : km_strerror(rc));
    }
    if (!rc)
        rc = check_worker_blocks(index, &staged);
    if (!rc)
        rc = check_lower_tiers(index, &staged);
    if (!rc)
        rc = check_segment_holders(index, &staged);
    if (!rc && check) {
        rc = check(check_user, user, (size_t)user_size);
        if (rc)
            km_index_fail(index, rc, "snapshot %s: the caller section was refused", path);
    }
    if (rc) {
        km_table_free(&staged.blocks);
        km_table_free(&staged.segments);
        for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++)
            km_table_free(&staged.lower[t]);
        km_u64map_free(&staged.anchors);
        km_pages_free(staged.anchor_nodes,
                      (uint64_t)staged.anchor_nodes_capacity * sizeof *staged.anchor_nodes);
        free(staged.workers);
        free(user);
        return rc;
    }

    /* Swap in. */
    km_table_free(&index->blocks);
    km_table_free(&index->segments);
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++) {
        km_table_free(&index->lower[t]);
        index->lower[t] = staged.lower[t];
        index->lower[t].memory = &index->memory;
    }
    km_u64map_free(&index->anchors);
    km_pages_free(index->anchor_nodes,
                  (uint64_t)index->anchor_nodes_capacity * sizeof *index->anchor_nodes);
    free(index->workers);
    index->blocks = staged.blocks;
    index->segments = staged.segments;
    km_index_forget_open_segments(index);
    index->anchors = staged.anchors;
    index->anchor_nodes = staged.anchor_nodes;
    index->anchor_nodes_capacity = staged.anchor_nodes_capacity;
    index->anchor_nodes_high = staged.anchor_nodes_high;
    index->anchor_free_head = staged.anchor_free_head;
    index->workers = staged.workers;
    index->memory.used = staged.memory.used;
    index->blocks.memory = &index->memory;
    index->segments.memory = &index->memory;
    index->anchors.memory = &index->memory;
    km_index_tables_replaced(index);
    if (user_out)
        *user_out = user;
    else
        free(user);
    if (user_size_out)
        *user_size_out = (size_t)user_size;
    return KM_OK;
}
