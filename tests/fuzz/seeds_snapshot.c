/* SPDX-License-Identifier: Apache-2.0 */
/* Writes a seed corpus for fuzz_snapshot into the directory given as argv[1]: snapshots of small
 * indexes (max_workers 8, segment_blocks 4, as the harness configures) holding chains, a widely
 * shared block (a bitmap set), host and disk tier pairs, with feed states in the caller section
 * (none, workers without maps, workers with engine-hash maps, parents and announcement counts). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/feed.h"
#include "kvmatch/index.h"

static km_index *new_index(void)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.max_workers = 8;
    cfg.segment_blocks = 4;
    cfg.initial_blocks = 16;
    cfg.threads = 1;
    cfg.backend = KM_BACKEND_CPU;
    km_index *index = NULL;
    if (km_index_create(&cfg, &index) != KM_OK)
        exit(1);
    return index;
}

typedef struct state_buf {
    unsigned char data[4096];
    size_t size;
} state_buf;

static void put(state_buf *b, const void *p, size_t n)
{
    memcpy(b->data + b->size, p, n);
    b->size += n;
}
static void put_u16(state_buf *b, uint16_t v) { put(b, &v, 2); }
static void put_u32(state_buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(state_buf *b, uint64_t v) { put(b, &v, 8); }

/* A feed state (src/events/feed_snapshot.c km_feed_export_state, version
 * KM_FEED_STATE_VERSION): workers 1 and 2 with engine-hash maps of a GPU, a CPU and a disk block;
 * worker 1 announces offloaded chunks by placeholders, with the blocks' parents and its CPU block
 * held by three announcements. */
static void feed_state(state_buf *b)
{
    b->size = 0;
    put(b, "KMFEEDST", 8);
    put_u32(b, KM_FEED_STATE_VERSION);
    put_u32(b, 16); /* block size */
    put_u32(b, 2);  /* workers */
    put_u32(b, 0);
    for (uint32_t w = 1; w <= 2; w++) {
        put_u32(b, w);
        /* replay, expected, last_live, placeholder chunks, parents / expected, degraded */
        put_u32(b, w == 1 ? 1u | 2u | 4u | 16u | 32u : 2u | 8u);
        put_u16(b, 3);
        put_u16(b, 5);
        put(b, w == 1 ? "one" : "two", 3);
        put(b, "tcp:x", 5);
        put_u64(b, 41);
        put_u64(b, 40);
        put_u64(b, 3); /* map entries */
        put_u32(b, 1); /* the engine's KV-cache groups: group 0 */
        put_u32(b, 0); /* no window groups */
        for (uint64_t k = 0; k < 3; k++) {
            put_u64(b, 0x100 + k);
            put_u64(b, 0x1000 + k);
            unsigned char copies[3] = {0, 0, 0};
            put(b, copies, 3);
            unsigned char media = (unsigned char)(1u << k); /* GPU, CPU, disk */
            put(b, &media, 1);
            put_u32(b, k == 0 ? 1u : 0u);
        }
        if (w == 1) {
            put_u64(b, 2); /* parents */
            for (uint64_t k = 1; k < 3; k++) {
                put_u64(b, 0x100 + k);
                put_u64(b, 0x100 + k - 1);
            }
            put_u64(b, 1); /* announcement counts */
            put_u64(b, 0x101);
            unsigned char medium = 1;
            put(b, &medium, 1);
            put_u16(b, 3);
        } else {
            put_u64(b, 0);
        }
    }
}

static int save(km_index *index, const char *dir, const char *name, const void *user, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (km_index_save(index, path, user, n) != KM_OK) {
        fprintf(stderr, "%s: %s\n", path, km_index_last_error(index));
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int bad = 0;

    km_index *index = new_index();
    bad |= save(index, dir, "empty.snap", NULL, 0);

    uint64_t chain[10];
    for (int i = 0; i < 10; i++)
        chain[i] = 0x1000 + (uint64_t)i;
    bad |= km_index_store(index, 1, KM_NO_PARENT, chain, 10) != KM_OK;
    bad |= km_index_store(index, 2, KM_NO_PARENT, chain, 6) != KM_OK;
    uint64_t branch[3] = {0x2000, 0x2001, 0x2002};
    bad |= km_index_store(index, 2, chain[5], branch, 3) != KM_OK;
    uint64_t orphan[2] = {0x3000, 0x3001};
    bad |= km_index_store(index, 3, 0x9999, orphan, 2) != KM_OK;
    for (uint32_t w = 0; w < 8; w++) /* block 0 held by all: a bitmap set */
        bad |= km_index_store(index, w, KM_NO_PARENT, chain, 1) != KM_OK;
    km_update tiers[2] = {
        {KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, &chain[7], 2, KM_TIER_HOST},
        {KM_UPDATE_SET_TIER, 2, KM_NO_PARENT, &branch[1], 2, KM_TIER_DISK},
    };
    bad |= km_index_apply(index, tiers, 2, NULL) != KM_OK;
    bad |= save(index, dir, "blocks.snap", NULL, 0);
    bad |= save(index, dir, "blocks_user.snap", "user bytes", 10);

    state_buf st;
    feed_state(&st);
    bad |= save(index, dir, "blocks_feed.snap", st.data, st.size);

    /* a feed that follows workers without maps, saved by km_feed_save */
    km_index *fi = new_index();
    km_feed_config fcfg;
    km_feed_config_init(&fcfg);
    km_feed *feed = NULL;
    bad |= km_feed_create(fi, &fcfg, &feed) != KM_OK;
    for (uint32_t w = 0; w < 3; w++) {
        km_feed_worker_config wc = {w, w ? "tcp://h:5557" : "w0", w == 2};
        bad |= km_feed_add_worker(feed, &wc, 1) != KM_OK;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/feed.snap", dir);
    if (km_feed_save(feed, path, 2) != KM_OK) {
        fprintf(stderr, "%s: %s\n", path, km_feed_last_error(feed));
        bad = 1;
    }
    km_feed_destroy(feed);
    km_index_destroy(fi);
    km_index_destroy(index);
    return bad;
}
