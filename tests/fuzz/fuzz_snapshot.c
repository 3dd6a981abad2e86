/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for snapshot loading: km_index_load (src/index/snapshot.c) and km_feed_restore
 * (the index part, then the feed state of its caller section, src/events/feed_snapshot.c).
 *
 * Input: a snapshot file. The checksums would stop nearly every mutation at the first check, so
 * when the input starts with the magic the harness seals it first (payload hash over the bytes
 * after the header, then the header hash): the structure checks behind them get fuzzed. The file
 * lives in a memfd, read through /proc/self/fd. The index has max_workers 8 and segment_blocks 4,
 * as tests/fuzz/seeds_snapshot.c writes them.
 *
 * Contracts checked: a refused file leaves a non-empty message and the index exactly as it was
 * (its known content still scores the same); a loaded index is usable: scoring, stores that
 * continue loaded blocks, removes and removing every worker work, and afterwards nothing is left.
 * km_feed_restore, into an index that holds something, either succeeds or leaves the index exactly
 * as it was and the feed following no worker. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvmatch/feed.h"
#include "kvmatch/index.h"
#include "events/feed_internal.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

#define MAX_WORKERS 8u
#define HEADER_BYTES 64u

static const uint64_t known[5] = {0x1111, 0x2222, 0x3333, 0x4444, 0x5555};

static void quiet(void *user, const char *line)
{
    (void)user, (void)line;
}

static km_index *new_index(void)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.max_workers = MAX_WORKERS;
    cfg.segment_blocks = 4;
    cfg.initial_blocks = 16;
    cfg.threads = 1;
    cfg.backend = KM_BACKEND_CPU;
    cfg.log = quiet;
    km_index *index = NULL;
    CHECK(km_index_create(&cfg, &index) == KM_OK);
    return index;
}

static uint32_t depth_of(km_index *index, uint32_t worker, const uint64_t *hashes, uint32_t n)
{
    km_match_results res;
    km_match_results_init(&res);
    km_request req = {hashes, n};
    CHECK(km_index_match_batch(index, &req, 1, &res) == KM_OK);
    uint32_t depth = 0;
    for (uint32_t i = 0; i < res.requests[0].count; i++)
        if (res.matches[res.requests[0].first + i].worker == worker)
            depth = res.matches[res.requests[0].first + i].depth;
    km_match_results_free(&res);
    return depth;
}

/* Exercise a loaded index with keys found in the file (any aligned word may be a loaded key). */
static void exercise(km_index *index, const uint8_t *data, size_t size)
{
    uint64_t words[64];
    uint32_t n = 0;
    for (size_t at = HEADER_BYTES; at + 8 <= size && n < 64; at += 8 * (1 + (size / 8) / 64)) {
        memcpy(&words[n], data + at, 8);
        if (words[n] > 1)
            n++;
    }
    km_match_results res;
    km_match_results_init(&res);
    km_request reqs[2] = {{words, n}, {known, 5}};
    CHECK(km_index_match_batch(index, reqs, 2, &res) == KM_OK);
    km_match_results_free(&res);
    /* continue loaded blocks, remove some, move some to lower tiers */
    for (uint32_t i = 0; i + 1 < n && i < 8; i++) {
        uint64_t next[2] = {words[i + 1] ^ 0x5a5a5a5a5a5a5a5aull, words[i] + 7};
        if (next[0] <= 1 || next[1] <= 1)
            continue;
        km_update ups[3] = {
            {KM_UPDATE_STORE, i % MAX_WORKERS, words[i], next, 2, (km_tier)(i % 3)},
            {KM_UPDATE_SET_TIER, (i + 1) % MAX_WORKERS, KM_NO_PARENT, &words[i], 1,
             (km_tier)((i + 1) % 3)},
            {KM_UPDATE_REMOVE, (i + 2) % MAX_WORKERS, KM_NO_PARENT, &words[i + 1], 1, KM_TIER_DEVICE},
        };
        km_update_stats st;
        int rc = km_index_apply(index, ups, 3, &st);
        CHECK(rc == KM_OK || rc == KM_ERR_MEMORY_CAP || rc == KM_ERR_OUT_OF_MEMORY);
    }
    for (uint32_t w = 0; w < MAX_WORKERS; w++)
        CHECK(km_index_remove_worker(index, w) == KM_OK);
    km_index_stats st;
    CHECK(km_index_get_stats(index, &st) == KM_OK);
    CHECK(st.pairs == 0 && st.blocks == 0 && st.host_pairs == 0 && st.disk_pairs == 0);
    CHECK(st.segment_pairs == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *file = malloc(size ? size : 1);
    CHECK(file);
    memcpy(file, data, size);
    if (size >= HEADER_BYTES && memcmp(file, "KVMSNAP1", 8) == 0) {
        uint64_t payload_hash = XXH3_64bits(file + HEADER_BYTES, size - HEADER_BYTES);
        memcpy(file + 40, &payload_hash, 8);
        uint64_t header_hash = XXH3_64bits(file, 56);
        memcpy(file + 56, &header_hash, 8);
    }
    int fd = memfd_create("snapshot", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(write(fd, file, size) == (ssize_t)size);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

    /* km_index_load into an index that holds something */
    km_index *index = new_index();
    CHECK(km_index_store(index, 1, KM_NO_PARENT, known, 5) == KM_OK);
    km_index_stats before, after;
    CHECK(km_index_get_stats(index, &before) == KM_OK);
    void *user = NULL;
    size_t user_size = 0;
    int rc = km_index_load(index, path, &user, &user_size);
    if (rc != KM_OK) {
        CHECK(rc < 0);
        CHECK(km_index_last_error(index)[0] != '\0');
        CHECK(user == NULL && user_size == 0);
        CHECK(km_index_get_stats(index, &after) == KM_OK);
        CHECK(after.pairs == before.pairs && after.blocks == before.blocks &&
              after.segment_pairs == before.segment_pairs);
        CHECK(depth_of(index, 1, known, 5) == 5);
    } else {
        CHECK(user_size == 0 || user != NULL);
        free(user);
        exercise(index, file, size);
    }
    km_index_destroy(index);

    /* km_feed_restore into a fresh feed over an index that holds something */
    index = new_index();
    CHECK(km_index_store(index, 1, KM_NO_PARENT, known, 5) == KM_OK);
    CHECK(km_index_get_stats(index, &before) == KM_OK);
    km_feed_config fcfg;
    km_feed_config_init(&fcfg);
    fcfg.log = quiet;
    /* An odd-sized input restores into a pool of two-block offloaded chunks (the maps keep
     * parents), an even-sized one into a pool that keeps none (parents are checked, dropped). */
    fcfg.offload_chunk_blocks = 1 + (uint32_t)(size & 1);
    km_feed *feed = NULL;
    CHECK(km_feed_create(index, &fcfg, &feed) == KM_OK);
    rc = km_feed_restore(feed, path, 1000);
    if (rc != KM_OK) {
        CHECK(rc < 0);
        CHECK(km_feed_last_error(feed)[0] != '\0');
        CHECK(km_index_get_stats(index, &after) == KM_OK);
        CHECK(after.pairs == before.pairs && after.blocks == before.blocks &&
              after.segment_pairs == before.segment_pairs);
        CHECK(depth_of(index, 1, known, 5) == 5);
        uint32_t followed = 1;
        CHECK(km_feed_get_workers(feed, NULL, 0, &followed) == KM_OK && followed == 0);
    } else {
        char why[256];
        CHECK(km_feed_check_maps(feed, why, sizeof why) == KM_OK);
        /* claim the restored workers, then flush what that queues */
        for (uint32_t w = 0; w < MAX_WORKERS; w++) {
            km_feed_worker_config wc = {w, "w", w & 1};
            int arc = km_feed_add_worker(feed, &wc, 2000);
            CHECK(arc == KM_OK);
        }
        CHECK(km_feed_flush(feed, 3000, NULL) == KM_OK);
    }
    km_feed_destroy(feed);
    km_index_destroy(index);
    close(fd);
    free(file);
    return 0;
}
