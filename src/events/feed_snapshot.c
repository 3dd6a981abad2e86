/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed's snapshots (include/kvmatch/feed.h, docs/EVENTS.md): km_feed_export_state /
 * km_feed_import_state turn the feed's per-worker stream positions and engine-hash maps into a
 * byte section and back, and km_feed_save / km_feed_restore store that section with the index in
 * one snapshot file, so a restart of kvmatch resumes each worker's stream where it left off. */
#include "kvmatch/feed.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error_detail.h"
#include "events/engine_hash_map.h"
#include "events/feed_internal.h"


/* ---- snapshots (restart of kvmatch) ---------------------------------------------------------- */

/* Feed state section, little-endian:
 *   header: magic "KMFEEDST" (8), version u32, block_size u32, n_workers u32, reserved u32 (0)
 *   per worker, ascending id:
 *     id u32, flags u32 (FS_*), name_len u16, identity_len u16, name, identity,
 *     expected u64, last_live u64, map_entries u64, gpu_groups u32 (the engine's KV-cache groups),
 *     window_groups u32 (those of them that are sliding windows: a subset of gpu_groups, never
 *     the bit of groups from 31 up), then per window group, lowest first, blocks u32 (>= 1),
 *     map_entries x {key u64 (mapped as km_u64map_key maps it: never 0 or 1), chain u64 (not 1),
 *                    extra_copies u8 x KM_EMAP_COPY_GROUPS (group g's GPU copies beyond the
 *                    first: 0 unless gpu_groups has g's bit), media u8 (1..31),
 *                    gpu_groups u32 (not 0 exactly when media has the GPU bit)},
 *     only with FS_HAS_PARENTS: n_parents u64 (<= map_entries),
 *       n_parents x {key u64 (an entry's, once), parent u64 (the parent's key mapped the same
 *                    way: never 0 or 1)},
 *     n_holds u64, n_holds x {key u64 (an entry's), medium u8 (1..KM_EMAP_HOLD_MEDIA, a medium
 *                    the entry's media hold), count u16 (>= 2; once per key and medium)}: the
 *                    announcements beyond the media bit's one
 *   nothing after the last worker. */
static const unsigned char FEED_MAGIC[8] = {'K', 'M', 'F', 'E', 'E', 'D', 'S', 'T'};
#define FS_HAS_REPLAY 1u
#define FS_HAS_EXPECTED 2u
#define FS_HAS_LAST_LIVE 4u
#define FS_DEGRADED 8u
#define FS_PLACEHOLDER_CHUNKS 16u
#define FS_HAS_PARENTS 32u
#define FS_KNOWN_FLAGS 63u
#define FS_ENTRY_BYTES (21u + KM_EMAP_COPY_GROUPS)
#define FS_PARENT_BYTES 16u
#define FS_HOLD_BYTES 11u
#define FS_MEDIUM_BIT_GPU (1u << KM_KV_MEDIUM_GPU)
/* The group bit standing for groups from 31 up, which no block gets (feed_updates.c). */
#define FS_GROUP_BIT_UNTRACKED (1u << 31)

typedef struct fs_writer {
    unsigned char *p;
    size_t at;
} fs_writer;

static void fs_put(fs_writer *w, const void *src, size_t n)
{
    memcpy(w->p + w->at, src, n);
    w->at += n;
}

static void fs_u64(fs_writer *w, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    fs_put(w, b, 8);
}

static void fs_u32(fs_writer *w, uint32_t v)
{
    unsigned char b[4];
    for (int i = 0; i < 4; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    fs_put(w, b, 4);
}

static void fs_u16(fs_writer *w, uint16_t v)
{
    unsigned char b[2] = {(unsigned char)v, (unsigned char)(v >> 8)};
    fs_put(w, b, 2);
}

int km_feed_export_state(const km_feed *feed, void **out, size_t *size_out)
{
    if (!feed || !out || !size_out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    *size_out = 0;
    if (feed->queue_count || feed->group_count || feed->taken_in_flight)
        return KM_ERR_INVALID_ARGUMENT;
    size_t size = 24;
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        const worker *w = feed->workers[i];
        size += 12 + strlen(w->name) + strlen(w->identity) + 28 + 4 +
                4 * (size_t)__builtin_popcount(w->window_groups) +
                (size_t)km_emap_live(&w->map) * FS_ENTRY_BYTES +
                (w->map.parents.live ? 8 + (size_t)w->map.parents.live * FS_PARENT_BYTES : 0) + 8 +
                (size_t)w->map.holds.live * KM_EMAP_HOLD_MEDIA * FS_HOLD_BYTES;
    }
    fs_writer wr = {malloc(size), 0};
    if (!wr.p)
        return KM_ERR_OUT_OF_MEMORY;
    fs_put(&wr, FEED_MAGIC, 8);
    fs_u32(&wr, KM_FEED_STATE_VERSION);
    fs_u32(&wr, feed->config.block_size);
    fs_u32(&wr, feed->n_workers);
    fs_u32(&wr, 0);
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        const worker *w = feed->workers[i];
        uint32_t flags = (w->has_replay ? FS_HAS_REPLAY : 0) | (w->has_expected ? FS_HAS_EXPECTED : 0) |
                         (w->has_last_live ? FS_HAS_LAST_LIVE : 0) |
                         (w->degraded ? FS_DEGRADED : 0) |
                         (w->placeholder_chunks ? FS_PLACEHOLDER_CHUNKS : 0) |
                         (w->map.parents.live ? FS_HAS_PARENTS : 0);
        size_t name_len = strlen(w->name), id_len = strlen(w->identity);
        fs_u32(&wr, w->id);
        fs_u32(&wr, flags);
        fs_u16(&wr, (uint16_t)name_len);
        fs_u16(&wr, (uint16_t)id_len);
        fs_put(&wr, w->name, name_len);
        fs_put(&wr, w->identity, id_len);
        fs_u64(&wr, w->has_expected ? w->expected : 0);
        fs_u64(&wr, w->has_last_live ? w->last_live : 0);
        fs_u64(&wr, km_emap_live(&w->map));
        fs_u32(&wr, w->gpu_groups);
        fs_u32(&wr, w->window_groups);
        for (uint32_t g = w->window_groups; g; g &= g - 1)
            fs_u32(&wr, w->window_blocks[__builtin_ctz(g)]);
        uint64_t cursor = 0;
        for (const km_emap_entry *e; (e = km_emap_next(&w->map, &cursor));) {
            fs_u64(&wr, e->key);
            fs_u64(&wr, e->chain);
            fs_put(&wr, e->extra_copies, KM_EMAP_COPY_GROUPS);
            fs_put(&wr, &e->media, 1);
            fs_u32(&wr, e->gpu_groups);
        }
        if (w->map.parents.live) {
            fs_u64(&wr, w->map.parents.live);
            cursor = 0;
            for (const km_u64map_entry *p; (p = km_u64map_next(&w->map.parents, &cursor));) {
                fs_u64(&wr, p->key);
                fs_u64(&wr, p->value);
            }
        }
        /* The count of held announcement records goes first: patched once they are written. */
        size_t count_at = wr.at;
        uint64_t n_holds = 0;
        fs_u64(&wr, 0);
        cursor = 0;
        for (const km_u64map_entry *h; (h = km_u64map_next(&w->map.holds, &cursor));) {
            for (unsigned medium = 1; medium <= KM_EMAP_HOLD_MEDIA; medium++) {
                uint16_t count = (uint16_t)(h->value >> (16 * (medium - 1)));
                if (!count)
                    continue;
                unsigned char m8 = (unsigned char)medium;
                fs_u64(&wr, h->key);
                fs_put(&wr, &m8, 1);
                fs_u16(&wr, count);
                n_holds++;
            }
        }
        size_t end = wr.at;
        wr.at = count_at;
        fs_u64(&wr, n_holds);
        wr.at = end;
    }
    *out = wr.p;
    *size_out = wr.at;
    return KM_OK;
}

typedef struct fs_reader {
    const unsigned char *p;
    size_t size, at;
} fs_reader;

static bool fs_take(fs_reader *r, void *dst, size_t n)
{
    if (r->size - r->at < n)
        return false;
    if (dst)
        memcpy(dst, r->p + r->at, n);
    r->at += n;
    return true;
}

static bool fs_get_u64(fs_reader *r, uint64_t *v)
{
    unsigned char b[8];
    if (!fs_take(r, b, 8))
        return false;
    *v = 0;
    for (int i = 7; i >= 0; i--)
        *v = (*v << 8) | b[i];
    return true;
}

static bool fs_get_u32(fs_reader *r, uint32_t *v)
{
    unsigned char b[4];
    if (!fs_take(r, b, 4))
        return false;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return true;
}

static bool fs_get_u16(fs_reader *r, uint16_t *v)
{
    unsigned char b[2];
    if (!fs_take(r, b, 2))
        return false;
    *v = (uint16_t)(b[0] | b[1] << 8);
    return true;
}

static void free_workers(worker **ws, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        km_feed_worker_free(ws[i]);
    free(ws);
}

/* The parents section of a worker whose map entries are read. A feed that walks no chunks of
 * several blocks validates the parents and drops them. KM_OK or an error with *why. */
static int parse_parents(fs_reader *r, worker *w, uint64_t entries, const char **why)
{
    uint64_t n = 0;
    if (!fs_get_u64(r, &n))
        return *why = "truncated parents", KM_ERR_CORRUPT;
    if (n > entries || n > (r->size - r->at) / FS_PARENT_BYTES)
        return *why = "more parents than blocks or than the section holds", KM_ERR_CORRUPT;
    km_u64map seen; /* the keys with a parent, for a map that keeps none */
    km_u64map *parents = &w->map.parents;
    if (!w->map.keep_parents) {
        km_u64map_init(&seen, NULL);
        parents = &seen;
    }
    int rc = km_u64map_reserve(parents, n) ? KM_ERR_OUT_OF_MEMORY : KM_OK;
    if (rc)
        *why = "parent map";
    for (uint64_t j = 0; j < n && !rc; j++) {
        uint64_t key = 0, parent = 0;
        fs_get_u64(r, &key);
        fs_get_u64(r, &parent);
        if (parent <= 1)
            rc = KM_ERR_CORRUPT, *why = "a parent key of 0 or 1";
        else if (key <= 1 || !km_emap_find(&w->map, key))
            rc = KM_ERR_CORRUPT, *why = "a parent of a block the map does not hold";
        else if (km_u64map_find(parents, key))
            rc = KM_ERR_CORRUPT, *why = "two parents of one block";
        else
            km_u64map_put(parents, key, parent, 0);
    }
    if (!w->map.keep_parents)
        km_u64map_free(&seen);
    return rc;
}

/* The announcement counts section of a worker whose map entries are read. KM_OK or an error with
 * *why. */
static int parse_holds(fs_reader *r, worker *w, uint64_t entries, const char **why)
{
    uint64_t n = 0;
    if (!fs_get_u64(r, &n))
        return *why = "truncated announcement counts", KM_ERR_CORRUPT;
    if (n > entries * KM_EMAP_HOLD_MEDIA || n > (r->size - r->at) / FS_HOLD_BYTES)
        return *why = "more announcement counts than blocks or than the section holds",
               KM_ERR_CORRUPT;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t key = 0;
        uint8_t medium = 0;
        uint16_t count = 0;
        fs_get_u64(r, &key);
        fs_take(r, &medium, 1);
        fs_get_u16(r, &count);
        const km_emap_entry *m = key > 1 ? km_emap_find(&w->map, key) : NULL;
        if (!m)
            return *why = "announcements of a block the map does not hold", KM_ERR_CORRUPT;
        if (medium < 1 || medium > KM_EMAP_HOLD_MEDIA || !(m->media >> medium & 1u))
            return *why = "announcements in a medium not holding the block", KM_ERR_CORRUPT;
        if (count < 2)
            return *why = "an announcement count below 2", KM_ERR_CORRUPT;
        if (km_emap_holds(&w->map, m, medium) > 1)
            return *why = "two announcement counts of one block and medium", KM_ERR_CORRUPT;
        if (km_emap_restore_holds(&w->map, m, medium, count) != KM_OK)
            return *why = "announcement map", KM_ERR_OUT_OF_MEMORY;
    }
    return KM_OK;
}

/* A feed state parsed and validated in full, not yet installed. */
typedef struct staged_state {
    worker **workers;
    uint32_t n_workers;
} staged_state;

/* Parse and validate a section into *out without touching the feed's workers (km_feed_fail
 * records why on failure; nothing is kept then). */
static int parse_state(km_feed *feed, const void *data, size_t size, staged_state *out)
{
    out->workers = NULL;
    out->n_workers = 0;
    fs_reader r = {data, size, 0};
    unsigned char magic[8];
    uint32_t version, block_size, n_workers, reserved;
    if (!fs_take(&r, magic, 8) || memcmp(magic, FEED_MAGIC, 8) != 0)
        return km_feed_fail(feed, KM_ERR_CORRUPT, "feed state: bad magic or truncated header");
    if (!fs_get_u32(&r, &version))
        return km_feed_fail(feed, KM_ERR_CORRUPT, "feed state: truncated header");
    if (version != KM_FEED_STATE_VERSION)
        return km_feed_fail(feed, KM_ERR_INCOMPATIBLE,
                            "feed state version %u (this build reads %u)", version,
                            KM_FEED_STATE_VERSION);
    if (!fs_get_u32(&r, &block_size) || !fs_get_u32(&r, &n_workers) || !fs_get_u32(&r, &reserved))
        return km_feed_fail(feed, KM_ERR_CORRUPT, "feed state: truncated header");
    if (reserved != 0)
        return km_feed_fail(feed, KM_ERR_CORRUPT,
                            "feed state: reserved header field is %u", reserved);
    if (block_size != feed->config.block_size)
        return km_feed_fail(feed, KM_ERR_INCOMPATIBLE, "feed state block size %u, feed has %u",
                            block_size, feed->config.block_size);
    /* Each worker takes at least 40 bytes: bounds the allocation by the input. */
    if (n_workers > (size - r.at) / 40)
        return km_feed_fail(feed, KM_ERR_CORRUPT,
                            "feed state: %u workers in %zu bytes", n_workers, size);
    worker **ws = calloc(n_workers ? n_workers : 1, sizeof *ws);
    if (!ws)
        return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "feed state: worker table");
    int rc = KM_OK;
    const char *why = "";
    uint32_t n = 0;
    while (n < n_workers) {
        uint32_t id, flags;
        uint16_t name_len, id_len;
        uint64_t expected, last_live, entries;
        uint32_t gpu_groups, window_groups = 0;
        km_worker_stats ws_stats;
        if (!fs_get_u32(&r, &id) || !fs_get_u32(&r, &flags) || !fs_get_u16(&r, &name_len) ||
            !fs_get_u16(&r, &id_len)) {
            rc = KM_ERR_CORRUPT, why = "truncated worker header";
            break;
        }
        if (flags & ~FS_KNOWN_FLAGS) {
            rc = KM_ERR_CORRUPT, why = "unknown worker flags";
            break;
        }
        if (n && id <= ws[n - 1]->id) {
            rc = KM_ERR_CORRUPT, why = "worker ids not ascending";
            break;
        }
        if (km_index_worker_stats(feed->index, id, &ws_stats) != KM_OK) {
            rc = KM_ERR_INCOMPATIBLE, why = "worker id outside the index";
            break;
        }
        if (name_len >= KM_FEED_NAME_MAX || id_len >= KM_FEED_NAME_MAX) {
            rc = KM_ERR_CORRUPT, why = "worker name too long";
            break;
        }
        worker *w = km_feed_worker_new(feed);
        if (!w) {
            rc = KM_ERR_OUT_OF_MEMORY, why = "worker state";
            break;
        }
        ws[n] = w;
        if (!fs_take(&r, w->name, name_len) || !fs_take(&r, w->identity, id_len) ||
            !fs_get_u64(&r, &expected) || !fs_get_u64(&r, &last_live) ||
            !fs_get_u64(&r, &entries) || !fs_get_u32(&r, &gpu_groups) ||
            !fs_get_u32(&r, &window_groups)) {
            rc = KM_ERR_CORRUPT, why = "truncated worker";
            n++;
            break;
        }
        n++;
        if ((window_groups & ~gpu_groups) || (window_groups & FS_GROUP_BIT_UNTRACKED)) {
            rc = KM_ERR_CORRUPT, why = "window groups outside the engine's groups";
            break;
        }
        for (uint32_t g = window_groups; g && !rc; g &= g - 1) {
            uint32_t blocks = 0;
            if (!fs_get_u32(&r, &blocks))
                rc = KM_ERR_CORRUPT, why = "truncated window groups";
            else if (!blocks)
                rc = KM_ERR_CORRUPT, why = "a window group of 0 blocks";
            w->window_blocks[__builtin_ctz(g)] = blocks;
        }
        if (rc)
            break;
        if (memchr(w->name, '\0', name_len) || memchr(w->identity, '\0', id_len)) {
            rc = KM_ERR_CORRUPT, why = "NUL inside a worker name";
            break;
        }
        if (entries > (r.size - r.at) / FS_ENTRY_BYTES) {
            rc = KM_ERR_CORRUPT, why = "map larger than the section";
            break;
        }
        if (!(flags & FS_HAS_EXPECTED) && (expected || entries)) {
            rc = KM_ERR_CORRUPT, why = "map or seq without a stream position";
            break;
        }
        w->id = id;
        w->has_replay = flags & FS_HAS_REPLAY;
        w->has_expected = flags & FS_HAS_EXPECTED;
        w->expected = expected;
        w->has_last_live = flags & FS_HAS_LAST_LIVE;
        w->last_live = last_live;
        w->last_live_restored = w->has_last_live;
        w->degraded = flags & FS_DEGRADED;
        w->placeholder_chunks = flags & FS_PLACEHOLDER_CHUNKS;
        w->gpu_groups = gpu_groups;
        w->window_groups = window_groups;
        if (entries && km_emap_size_for(&w->map, entries) != KM_OK) {
            rc = KM_ERR_OUT_OF_MEMORY, why = "engine-hash map";
            break;
        }
        for (uint64_t j = 0; j < entries && !rc; j++) {
            uint64_t key = 0, chain = 0;
            uint8_t media = 0, copies[KM_EMAP_COPY_GROUPS] = {0};
            uint32_t groups = 0;
            fs_get_u64(&r, &key);
            fs_get_u64(&r, &chain);
            fs_take(&r, copies, KM_EMAP_COPY_GROUPS);
            fs_take(&r, &media, 1);
            fs_get_u32(&r, &groups);
            /* Keys are stored mapped (km_u64map_key), so never 0 or 1; the map maps them again,
             * which leaves such keys as they are. */
            if (key <= 1 || media == 0 || media >= (1u << MEDIUM_COUNT) ||
                !(media & FS_MEDIUM_BIT_GPU) != !groups || (groups & FS_GROUP_BIT_UNTRACKED)) {
                rc = KM_ERR_CORRUPT, why = "bad map entry";
                break;
            }
            /* A chain hash is 0 (the block could not be hashed) or a remapped hash, never the
             * index's reserved 1 (docs/HASHING.md): it would reach the index in an update. */
            if (chain == 1) {
                rc = KM_ERR_CORRUPT, why = "a map entry's chain hash is the reserved value 1";
                break;
            }
            bool copies_ok = true;
            for (uint32_t g = 0; g < KM_EMAP_COPY_GROUPS; g++)
                copies_ok &= !copies[g] || (groups >> g & 1u);
            if (!copies_ok) {
                rc = KM_ERR_CORRUPT, why = "copies in a group not holding the block";
                break;
            }
            if (km_emap_find(&w->map, key)) {
                rc = KM_ERR_CORRUPT, why = "duplicate map entry";
                break;
            }
            km_emap_entry *m = km_emap_upsert(&w->map, key);
            m->chain = chain;
            m->media = media;
            memcpy(m->extra_copies, copies, KM_EMAP_COPY_GROUPS);
            m->gpu_groups = groups;
        }
        if (!rc && (flags & FS_HAS_PARENTS))
            rc = parse_parents(&r, w, entries, &why);
        if (!rc)
            rc = parse_holds(&r, w, entries, &why);
        if (rc)
            break;
    }
    if (!rc && r.at != r.size)
        rc = KM_ERR_CORRUPT, why = "trailing bytes";
    if (rc) {
        free_workers(ws, n);
        return km_feed_fail(feed, rc, "feed state: %s (worker record %u)", why, n);
    }
    out->workers = ws;
    out->n_workers = n_workers;
    return KM_OK;
}

/* Install a parsed state into a feed that follows no worker: nothing here fails. */
static void install_state(km_feed *feed, staged_state *st, uint64_t now_ns)
{
    worker **ws = st->workers;
    uint32_t n_workers = st->n_workers;
    st->workers = NULL;
    st->n_workers = 0;
    free(feed->workers);
    feed->workers = ws;
    feed->workers_capacity = n_workers ? n_workers : 1;
    feed->n_workers = n_workers;
    for (uint32_t i = 0; i < n_workers; i++) {
        worker *w = ws[i];
        w->generation = ++feed->next_generation;
        w->restored = true;
        w->awaiting_claim = true;
        if (w->has_expected)
            km_feed_open_recovery(w, KM_FEED_WINDOW_RESUME, now_ns, w->expected);
        else
            km_feed_open_recovery(w, KM_FEED_WINDOW_STARTUP, now_ns, 0);
        if (w->degraded) { /* stays DEGRADED; nothing is dropped (restoring loses nothing) */
            km_feed_window_init(&w->degraded_window, KM_FEED_WINDOW_DEGRADED, now_ns, 0);
            w->degraded_open = true;
            w->windows_total++;
        }
        /* The index was loaded without window rules (they are not in its snapshot). */
        w->index_window_groups = 0;
        w->index_rule_failed = true;
    }
    km_feed_sync_window_rules(feed);
    feed->last_error[0] = '\0';
}

int km_feed_import_state(km_feed *feed, const void *data, size_t size, uint64_t now_ns)
{
    if (!feed || (!data && size))
        return KM_ERR_NULL_POINTER;
    if (feed->n_workers)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT,
                            "restore into a feed that follows workers");
    staged_state st;
    int rc = parse_state(feed, data, size, &st);
    if (rc)
        return rc;
    install_state(feed, &st, now_ns);
    return KM_OK;
}

int km_feed_save(km_feed *feed, const char *path, uint64_t now_ns)
{
    if (!feed || !path)
        return KM_ERR_NULL_POINTER;
    if (feed->taken_in_flight)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT,
                            "a flush is being applied: save once it has finished");
    int rc = km_feed_flush(feed, now_ns, NULL);
    if (rc)
        return rc;
    void *state = NULL;
    size_t size = 0;
    rc = km_feed_export_state(feed, &state, &size);
    if (rc)
        return km_feed_fail(feed, rc, "exporting the feed state");
    rc = km_index_save(feed->index, path, state, size);
    free(state);
    if (rc)
        return km_feed_fail(feed, rc, "%s",
                            km_error_detail(km_index_last_error(feed->index), rc));
    feed->last_error[0] = '\0';
    return KM_OK;
}

/* km_index_load_checked's judge of the caller section: the feed state parsed into the staging
 * area, so that the index is replaced only when the feed's part is valid too. */
typedef struct restore_check {
    km_feed *feed;
    staged_state staged;
} restore_check;

static int check_feed_section(void *user, const void *section, size_t size)
{
    restore_check *rc = user;
    return parse_state(rc->feed, section, size, &rc->staged);
}

int km_feed_restore(km_feed *feed, const char *path, uint64_t now_ns)
{
    if (!feed || !path)
        return KM_ERR_NULL_POINTER;
    if (feed->n_workers || feed->queue_count)
        return km_feed_fail(feed, KM_ERR_INVALID_ARGUMENT, "restore into a feed that is in use");
    /* The feed section is judged before the index part is installed: on any failure neither the
     * index nor the feed changes. */
    restore_check check = {feed, {NULL, 0}};
    feed->last_error[0] = '\0';
    int rc = km_index_load_checked(feed->index, path, check_feed_section, &check, NULL, NULL);
    if (rc) {
        if (feed->last_error[0]) { /* the feed section was refused: say why */
            char detail[sizeof feed->last_error];
            snprintf(detail, sizeof detail, "%s", feed->last_error);
            return km_feed_fail(feed, rc, "snapshot %s: %s", path, km_error_detail(detail, rc));
        }
        return km_feed_fail(feed, rc, "snapshot %s: %s", path,
                            km_error_detail(km_index_last_error(feed->index), rc));
    }
    install_state(feed, &check.staged, now_ns);
    return KM_OK;
}
