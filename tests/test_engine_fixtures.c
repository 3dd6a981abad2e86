/* SPDX-License-Identifier: Apache-2.0 */
/* Payloads encoded by vLLM's and SGLang's own event classes and msgspec encoders
 * (tests/engine_fixtures/, written by scripts/check-engines.py from the engines' wheels, with the
 * expected index content computed in Python from docs/HASHING.md): decoded, fed to a worker from
 * seq 0 and flushed, the worker's index must hold exactly the expected chains, each in its tier.
 * Covers lookahead hashing, LoRA under Dynamo's seed rule with a CPU offload, the cache salt in
 * vLLM's extra keys and as SGLang's own field, SGLang's CPU_PINNED and EXTERNAL media. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "test_util.h"

#define FIXTURE_DIR "tests/engine_fixtures"

static size_t unhex(const char *hex, unsigned char *out, size_t cap)
{
    size_t n = 0;
    for (; hex[0] && hex[1] && hex[0] != '\n' && n < cap; hex += 2) {
        unsigned v;
        cr_assert_eq(sscanf(hex, "%2x", &v), 1, "bad hex");
        out[n++] = (unsigned char)v;
    }
    return n;
}

static void run_fixture(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    static char line[1 << 16];
    static unsigned char payload[1 << 15];
    km_index *index = km_test_make_index(4);
    km_feed *feed = NULL;
    km_kv_decoder *dec = NULL;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    uint64_t seq = 0, now = 1000, expect[16];
    uint32_t tiers[16], n_expect = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "config ", 7)) {
            km_feed_config cfg;
            unsigned bs, la;
            cr_assert_eq(sscanf(line + 7, "%u %u", &bs, &la), 2);
            km_test_feed_config(&cfg, bs);
            cfg.hash_lookahead_tokens = la;
            cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_OK);
            km_feed_worker_config wc = {0, "engine", false};
            cr_assert_eq(km_feed_add_worker(feed, &wc, now++), KM_OK);
        } else if (!strncmp(line, "payload ", 8)) {
            cr_assert_not_null(feed, "%s: payload before config", path);
            size_t n = unhex(line + 8, payload, sizeof payload);
            km_kv_batch b;
            int rc = km_kv_decode_payload(dec, payload, n, &b);
            cr_assert_eq(rc, KM_OK, "%s seq %llu: %s", path, (unsigned long long)seq,
                         km_kv_decoder_last_error(dec));
            cr_assert_eq(b.n_rejected, 0, "%s seq %llu: %s", path, (unsigned long long)seq,
                         b.n_rejected ? b.rejected[0].message : "");
            cr_assert_eq(km_feed_live(feed, 0, seq++, &b, now++), KM_OK);
        } else if (!strncmp(line, "expect ", 7)) {
            char tier[16];
            unsigned long long chain;
            cr_assert_eq(sscanf(line + 7, "%llx %15s", &chain, tier), 2);
            cr_assert_lt(n_expect, 16);
            expect[n_expect] = chain;
            tiers[n_expect++] = !strcmp(tier, "host") ? KM_TIER_HOST
                                : !strcmp(tier, "disk") ? KM_TIER_DISK
                                                        : KM_TIER_DEVICE;
        }
    }
    fclose(f);
    cr_assert_not_null(feed, "%s: no config line", path);
    cr_assert_eq(km_feed_flush(feed, now++, NULL), KM_OK);
    char why[256];
    cr_assert(km_test_index_holds_exactly(index, 0, expect, n_expect, why, sizeof why), "%s: %s",
              path, why);
    for (uint32_t i = 0; i < n_expect; i++) {
        km_match_results res;
        km_match_results_init(&res);
        km_request q = {&expect[i], 1};
        cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
        cr_assert_eq(res.requests[0].count, 1);
        uint32_t got = res.tiers[0].host_blocks   ? KM_TIER_HOST
                       : res.tiers[0].disk_blocks ? KM_TIER_DISK
                                                  : KM_TIER_DEVICE;
        cr_assert_eq(got, tiers[i], "%s: chain %u in tier %u, expected %u", path, i, got, tiers[i]);
        km_match_results_free(&res);
    }
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, 0, &info), KM_OK);
    for (unsigned r = 0; r < KM_FEED_REFUSAL_COUNT; r++)
        cr_assert_eq(info.counters.refused[r], 0, "%s: %s refused", path,
                     km_feed_refusal_name((km_feed_refusal)r));
    km_feed_destroy(feed);
    km_kv_decoder_destroy(dec);
    km_index_destroy(index);
}

Test(engine_fixtures, engines_own_encodings_give_the_expected_index, .timeout = 30)
{
    DIR *d = opendir(FIXTURE_DIR);
    cr_assert_not_null(d, "%s missing (run from the repository root)", FIXTURE_DIR);
    unsigned n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".txt"))
            continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", FIXTURE_DIR, e->d_name);
        run_fixture(path);
        n++;
    }
    closedir(d);
    cr_assert_geq(n, 4, "only %u fixtures", n);
}
