/* SPDX-License-Identifier: Apache-2.0 */
/* Storage tiers (index.h km_tier, docs/EVENTS.md "Storage tiers"): every (block, worker) pair has
 * a best tier; scoring splits each worker's matched prefix into device / host / disk blocks.
 * Covered: random update batches with tiers (STORE with a tier, SET_TIER, REMOVE, CLEAR) against
 * a brute-force model of every pair's tier, checked through scoring and km_index_pair_tier;
 * rollback of a failed batch restores tiers; snapshots keep them; bad tiers are refused; and the
 * event feed turns per-medium BlockStored / BlockRemoved into the right best tier. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "test_util.h"
#include "base/u64_map.h"

/* ---- the model: (hash, worker) -> tier, for pairs the oracle says are held ------------------------ */

typedef struct tier_model {
    km_u64map map; /* key: XXH3 of (hash, worker), remapped; value: worker << 8 | tier */
    km_memory memory;
} tier_model;

static uint64_t pair_key(uint64_t hash, uint32_t worker)
{
    uint64_t in[2] = {hash, worker};
    return km_u64map_key(XXH3_64bits(in, sizeof in));
}

static km_tier model_tier(const tier_model *m, uint64_t hash, uint32_t worker)
{
    uint64_t *v = km_u64map_find(&m->map, pair_key(hash, worker));
    return v ? (km_tier)(*v & 0xff) : KM_TIER_DEVICE;
}

static void model_set(tier_model *m, uint64_t hash, uint32_t worker, km_tier tier)
{
    if (tier == KM_TIER_DEVICE)
        km_u64map_erase(&m->map, pair_key(hash, worker));
    else
        cr_assert_eq(km_u64map_put(&m->map, pair_key(hash, worker), (uint64_t)worker << 8 | tier, 1),
                     KM_OK);
}

static void model_clear_worker(tier_model *m, uint32_t worker)
{
    /* Collect first: an erase moves entries, so the map must not change during the iteration. */
    uint64_t *doomed = malloc((m->map.live + 1) * sizeof *doomed), n = 0, cursor = 0;
    cr_assert_not_null(doomed);
    for (km_u64map_entry *e; (e = km_u64map_next(&m->map, &cursor));)
        if ((e->value >> 8) == worker)
            doomed[n++] = e->key;
    for (uint64_t i = 0; i < n; i++)
        cr_assert_eq(km_u64map_erase(&m->map, doomed[i]), 1);
    free(doomed);
}

/* Apply one update to the model, the oracle holding the pre-update state; returns tier changes. */
static uint64_t model_apply(tier_model *m, km_oracle *o, const km_update *u)
{
    uint64_t changes = 0;
    switch (u->kind) {
    case KM_UPDATE_STORE:
        for (size_t i = 0; i < u->n_hashes; i++) {
            changes += model_tier(m, u->hashes[i], u->worker) != u->tier;
            model_set(m, u->hashes[i], u->worker, u->tier);
        }
        break;
    case KM_UPDATE_SET_TIER:
        for (size_t i = 0; i < u->n_hashes; i++) {
            if (!km_oracle_holds(o, u->worker, u->hashes[i]))
                continue;
            changes += model_tier(m, u->hashes[i], u->worker) != u->tier;
            model_set(m, u->hashes[i], u->worker, u->tier);
        }
        return changes; /* the oracle does not know SET_TIER */
    case KM_UPDATE_REMOVE:
        for (size_t i = 0; i < u->n_hashes; i++)
            model_set(m, u->hashes[i], u->worker, KM_TIER_DEVICE);
        break;
    case KM_UPDATE_CLEAR_WORKER:
    case KM_UPDATE_REMOVE_WORKER:
        model_clear_worker(m, u->worker);
        break;
    }
    km_update_stats ignored;
    km_oracle_apply(o, u, 1, &ignored);
    return changes;
}

/* Every request's tier split (and depth) against the model. */
static void check_scoring(km_index *index, const km_oracle *o, const tier_model *m,
                          const km_request_set *rs, km_match_results *res, uint32_t S)
{
    int rc = km_index_match_batch(index, rs->requests, rs->n, res);
    KM_CHECK(rc == KM_OK, "match: %s", km_index_last_error(index));
    char why[256];
    KM_CHECK(km_check_results(o, rs->requests, rs->n, res, S, why, sizeof why), "%s", why);
    for (size_t q = 0; q < rs->n; q++) {
        const km_request_result *rr = &res->requests[q];
        for (uint32_t j = 0; j < rr->count; j++) {
            const km_worker_match *mt = &res->matches[rr->first + j];
            uint32_t host = 0, disk = 0;
            for (uint32_t i = 0; i < mt->depth; i++) {
                km_tier t = model_tier(m, rs->requests[q].hashes[i], mt->worker);
                host += t == KM_TIER_HOST;
                disk += t == KM_TIER_DISK;
            }
            const km_match_tiers *got = &res->tiers[rr->first + j];
            KM_CHECK(got->host_blocks == host && got->disk_blocks == disk,
                     "request %zu worker %u depth %u: host %u disk %u, model host %u disk %u", q,
                     mt->worker, mt->depth, got->host_blocks, got->disk_blocks, host, disk);
        }
    }
}

/* Random tiers on the workload's stores, plus SET_TIER updates over random stretches of the
 * corpus (held or not) and occasional REMOVE of a tiered range. */
static size_t add_tier_updates(km_workload *w, km_rng *r, const km_corpus *c, km_update *out,
                               size_t n_out_max)
{
    size_t n = 0;
    for (size_t i = 0; i < w->n_updates && n < n_out_max; i++) {
        out[n] = w->updates[i];
        if (out[n].kind == KM_UPDATE_STORE)
            out[n].tier = (km_tier)km_rng_below(r, KM_TIER_COUNT);
        n++;
        if (km_rng_percent(r, 40) && n < n_out_max) {
            const km_seq *s = &c->seqs[km_rng_below(r, (uint32_t)c->n_seqs)];
            if (s->n_blocks == 0)
                continue;
            uint32_t a = km_rng_below(r, s->n_blocks);
            uint32_t len = 1 + km_rng_below(r, s->n_blocks - a);
            km_update u = {KM_UPDATE_SET_TIER, km_rng_below(r, w->n_workers_used), KM_NO_PARENT,
                           s->chain + a, len, (km_tier)km_rng_below(r, KM_TIER_COUNT)};
            out[n++] = u;
        }
    }
    return n;
}

Test(tiers, random_batches_against_model, .timeout = 120)
{
    uint64_t seed = km_test_seed();
    km_rng r;
    km_rng_init(&r, seed);
    for (int round = 0; round < 3; round++) {
        const uint32_t W = round == 2 ? 300 : 12; /* 300: bitmap sets in the tier tables too */
        km_corpus c;
        km_corpus_generate(&c, &r, 60, 4, 40);
        km_index_config cfg;
        km_test_config(&cfg, NULL);
        cfg.max_workers = W;
        cfg.segment_blocks = round == 1 ? 0 : 4;
        km_index *index;
        cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
        km_oracle o;
        km_oracle_init(&o, W);
        tier_model m = {0};
        km_u64map_init(&m.map, &m.memory);
        km_workload wl;
        km_workload_init(&wl, &c, W);
        km_request_set rs = {0};
        km_match_results res;
        km_match_results_init(&res);
        km_update batch[512];
        uint64_t total_changes = 0, max_lower_pairs = 0;
        for (int step = 0; step < 150; step++) {
            km_workload_step(&wl, &r, &o, 12);
            size_t n = add_tier_updates(&wl, &r, &c, batch, 512);
            km_update_stats st;
            int rc = km_index_apply(index, batch, n, &st);
            KM_CHECK(rc == KM_OK, "apply: %s", km_index_last_error(index));
            uint64_t changes = 0;
            for (size_t i = 0; i < n; i++)
                changes += model_apply(&m, &o, &batch[i]);
            KM_CHECK(st.tier_changes == changes, "step %d: tier_changes %llu, model %llu", step,
                     (unsigned long long)st.tier_changes, (unsigned long long)changes);
            total_changes += changes;
            if (step % 10 == 9) {
                km_request_set_generate(&rs, &r, &c, 80);
                check_scoring(index, &o, &m, &rs, &res, cfg.segment_blocks);
                /* Spot-check km_index_pair_tier and the pair counts. */
                km_index_stats is;
                km_index_get_stats(index, &is);
                uint64_t host = 0, disk = 0;
                uint64_t cursor = 0;
                for (km_u64map_entry *e; (e = km_u64map_next(&m.map, &cursor));) {
                    host += (e->value & 0xff) == KM_TIER_HOST;
                    disk += (e->value & 0xff) == KM_TIER_DISK;
                }
                KM_CHECK(is.host_pairs == host && is.disk_pairs == disk,
                         "pairs host %llu disk %llu, model %llu %llu",
                         (unsigned long long)is.host_pairs, (unsigned long long)is.disk_pairs,
                         (unsigned long long)host, (unsigned long long)disk);
                if (host + disk > max_lower_pairs)
                    max_lower_pairs = host + disk;
                const km_seq *s = &c.seqs[km_rng_below(&r, (uint32_t)c.n_seqs)];
                for (uint32_t i = 0; i < s->n_blocks; i++)
                    for (uint32_t wk = 0; wk < wl.n_workers_used; wk++) {
                        km_tier t;
                        rc = km_index_pair_tier(index, s->chain[i], wk, &t);
                        if (km_oracle_holds(&o, wk, s->chain[i]))
                            KM_CHECK(rc == KM_OK && t == model_tier(&m, s->chain[i], wk),
                                     "pair tier %d rc %d", (int)t, rc);
                        else
                            KM_CHECK(rc == KM_ERR_NOT_FOUND, "absent pair: rc %d", rc);
                    }
            }
        }
        /* The run must have exercised tiers, not only device-resident pairs. */
        KM_CHECK(total_changes > 100 && max_lower_pairs > 50, "too few tier changes (%llu) or "
                 "lower-tier pairs (%llu) to mean anything", (unsigned long long)total_changes,
                 (unsigned long long)max_lower_pairs);
        km_match_results_free(&res);
        km_request_set_free(&rs);
        km_workload_free(&wl);
        km_u64map_free(&m.map);
        km_oracle_free(&o);
        km_index_destroy(index);
        km_corpus_free(&c);
    }
}

/* A seq of n chain hashes (arbitrary but valid keys). */
static void make_chain(uint64_t *h, uint32_t n, uint64_t salt)
{
    uint64_t parent = KM_NO_PARENT;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t local = km_hash_remap(XXH3_64bits_withSeed(&i, sizeof i, salt));
        h[i] = parent == KM_NO_PARENT ? km_hash_chain_root(local) : km_hash_chain_step(parent, local);
        parent = h[i];
    }
}

Test(tiers, split_and_rollback, .timeout = 30)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.max_workers = 8;
    cfg.segment_blocks = 4;
    km_index *index;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    uint64_t h[16];
    make_chain(h, 16, 7);
    /* Worker 1: blocks 0..9 on device, then 4..7 moved to host and 8..9 to disk. */
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 10), KM_OK);
    km_update ups[2] = {{KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, h + 4, 4, KM_TIER_HOST},
                        {KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, h + 8, 2, KM_TIER_DISK}};
    km_update_stats st;
    cr_assert_eq(km_index_apply(index, ups, 2, &st), KM_OK);
    cr_assert_eq(st.tier_changes, 6);
    /* Worker 2: blocks 0..5 all on host (stored there directly). */
    km_update s2 = {KM_UPDATE_STORE, 2, KM_NO_PARENT, h, 6, KM_TIER_HOST};
    cr_assert_eq(km_index_apply(index, &s2, 1, NULL), KM_OK);
    km_request rq = {h, 16};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, &rq, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].count, 2);
    cr_assert_eq(res.matches[0].worker, 1);
    cr_assert_eq(res.matches[0].depth, 10);
    cr_assert_eq(res.tiers[0].host_blocks, 4);
    cr_assert_eq(res.tiers[0].disk_blocks, 2);
    cr_assert_eq(res.matches[1].worker, 2);
    cr_assert_eq(res.tiers[1].host_blocks, 6);
    cr_assert_eq(res.tiers[1].disk_blocks, 0);

    /* An unknown tier is refused before anything runs: nothing changes. */
    km_update bad[2] = {{KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, h, 10, KM_TIER_DISK},
                        {KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, h, 10, (km_tier)7}};
    cr_assert_eq(km_index_apply(index, bad, 2, NULL), KM_ERR_INVALID_ARGUMENT);
    km_tier t0;
    cr_assert_eq(km_index_pair_tier(index, h[0], 1, &t0), KM_OK);
    cr_assert_eq(t0, KM_TIER_DEVICE);

    /* A batch that changes tiers and then fails half way on the memory cap is rolled back, tiers
     * included. The same state again, in an index capped just above what it needs. */
    km_index_stats is;
    km_index_get_stats(index, &is);
    km_index_destroy(index);
    cfg.memory_cap_bytes = is.memory_bytes + 4096;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 10), KM_OK);
    cr_assert_eq(km_index_apply(index, ups, 2, NULL), KM_OK);
    size_t big_n = 200000;
    uint64_t *big = malloc(big_n * sizeof *big);
    cr_assert_not_null(big);
    make_chain(big, (uint32_t)big_n, 99);
    km_update failing[2] = {{KM_UPDATE_SET_TIER, 1, KM_NO_PARENT, h, 4, KM_TIER_DISK},
                            {KM_UPDATE_STORE, 3, KM_NO_PARENT, big, big_n, KM_TIER_HOST}};
    cr_assert_eq(km_index_apply(index, failing, 2, NULL), KM_ERR_MEMORY_CAP);
    for (uint32_t i = 0; i < 10; i++) {
        km_tier t;
        cr_assert_eq(km_index_pair_tier(index, h[i], 1, &t), KM_OK);
        km_tier want = i < 4 ? KM_TIER_DEVICE : i < 8 ? KM_TIER_HOST : KM_TIER_DISK;
        cr_assert_eq(t, want, "block %u: tier %d after rollback, want %d", i, (int)t, (int)want);
    }
    km_index_get_stats(index, &is);
    cr_assert_eq(is.host_pairs, 4);
    cr_assert_eq(is.disk_pairs, 2);

    /* Remove and clear take pairs out of the lower tiers too. */
    cr_assert_eq(km_index_remove(index, 1, h + 4, 1), KM_OK);
    km_index_get_stats(index, &is);
    cr_assert_eq(is.host_pairs, 3);
    cr_assert_eq(km_index_clear_worker(index, 1), KM_OK);
    km_index_get_stats(index, &is);
    cr_assert_eq(is.host_pairs + is.disk_pairs, 0);
    free(big);
    km_match_results_free(&res);
    km_index_destroy(index);
}

/* Results reused across batches: every batch's split equals one counted pair by pair with
 * km_index_pair_tier, while the lower tiers fill, empty again (then the split writes nothing and
 * the entries an earlier batch counted into must read zero) and the batches grow and shrink. */
Test(tiers, a_reused_results_splits_every_batch_afresh, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.max_workers = 2 + km_rng_below(&r, 100); /* above 64: bitmap sets */
    cfg.segment_blocks = 4;
    km_index *index;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    enum { CHAINS = 24, BLOCKS = 40 };
    uint64_t h[CHAINS][BLOCKS];
    for (uint32_t c = 0; c < CHAINS; c++) {
        make_chain(h[c], BLOCKS, 1000 + c);
        for (uint32_t w = 0; w < cfg.max_workers; w++)
            if (km_rng_percent(&r, 50))
                cr_assert_eq(km_index_store(index, w, KM_NO_PARENT, h[c],
                                            1 + km_rng_below(&r, BLOCKS)), KM_OK);
    }
    km_request rq[CHAINS];
    km_match_results res;
    km_match_results_init(&res);
    int lower_then_empty = 0, was_lower = 0;
    for (int step = 0; step < 60; step++) {
        /* Odd steps move random stretches to host or disk; one step in three moves everything
         * back to the device, emptying the lower tiers. */
        if (step % 3 == 2) {
            for (uint32_t c = 0; c < CHAINS; c++)
                for (uint32_t w = 0; w < cfg.max_workers; w++) {
                    km_update u = {KM_UPDATE_SET_TIER, w, KM_NO_PARENT, h[c], BLOCKS,
                                   KM_TIER_DEVICE};
                    cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK);
                }
        } else if (step % 2 == 1) {
            for (int k = 0; k < 40; k++) {
                uint32_t a = km_rng_below(&r, BLOCKS);
                km_update u = {KM_UPDATE_SET_TIER, km_rng_below(&r, cfg.max_workers),
                               KM_NO_PARENT, h[km_rng_below(&r, CHAINS)] + a,
                               1 + km_rng_below(&r, BLOCKS - a),
                               km_rng_percent(&r, 50) ? KM_TIER_HOST : KM_TIER_DISK};
                cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK);
            }
        }
        km_index_stats is;
        km_index_get_stats(index, &is);
        int lower = is.host_pairs + is.disk_pairs > 0;
        lower_then_empty |= was_lower && !lower;
        size_t n = 1 + km_rng_below(&r, CHAINS);
        for (size_t q = 0; q < n; q++)
            rq[q] = (km_request){h[km_rng_below(&r, CHAINS)], 1 + km_rng_below(&r, BLOCKS)};
        cr_assert_eq(km_index_match_batch(index, rq, n, &res), KM_OK);
        for (size_t q = 0; q < n; q++) {
            const km_request_result *rr = &res.requests[q];
            for (uint32_t j = 0; j < rr->count; j++) {
                const km_worker_match *m = &res.matches[rr->first + j];
                uint32_t host = 0, disk = 0;
                for (uint32_t i = 0; i < m->depth; i++) {
                    km_tier t;
                    cr_assert_eq(km_index_pair_tier(index, rq[q].hashes[i], m->worker, &t), KM_OK);
                    host += t == KM_TIER_HOST;
                    disk += t == KM_TIER_DISK;
                }
                const km_match_tiers *got = &res.tiers[rr->first + j];
                cr_assert(got->host_blocks == host && got->disk_blocks == disk,
                          "step %d request %zu worker %u: host %u disk %u, pair by pair %u %u",
                          step, q, m->worker, got->host_blocks, got->disk_blocks, host, disk);
            }
        }
        was_lower = lower;
    }
    cr_assert(lower_then_empty, "no batch followed one with lower-tier pairs on emptied tiers");
    km_match_results_free(&res);
    km_index_destroy(index);
}

Test(tiers, snapshot_keeps_tiers, .timeout = 30)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.max_workers = 300;
    km_index *a, *b;
    cr_assert_eq(km_index_create(&cfg, &a), KM_OK);
    cr_assert_eq(km_index_create(&cfg, &b), KM_OK);
    uint64_t h[40];
    make_chain(h, 40, 3);
    for (uint32_t w = 0; w < 300; w += 7) {
        km_update u = {KM_UPDATE_STORE, w, KM_NO_PARENT, h, 10 + w % 30, (km_tier)(w % 3)};
        cr_assert_eq(km_index_apply(a, &u, 1, NULL), KM_OK);
    }
    char path[] = "/tmp/kvmatch-tiers-XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert_eq(km_index_save(a, path, NULL, 0), KM_OK, "%s", km_index_last_error(a));
    cr_assert_eq(km_index_load(b, path, NULL, NULL), KM_OK, "%s", km_index_last_error(b));
    unlink(path);
    km_request rq = {h, 40};
    km_match_results ra, rb;
    km_match_results_init(&ra);
    km_match_results_init(&rb);
    cr_assert_eq(km_index_match_batch(a, &rq, 1, &ra), KM_OK);
    cr_assert_eq(km_index_match_batch(b, &rq, 1, &rb), KM_OK);
    cr_assert_eq(ra.n_matches, rb.n_matches);
    cr_assert_gt(ra.n_matches, 40);
    for (size_t j = 0; j < ra.n_matches; j++) {
        cr_assert_eq(ra.matches[j].worker, rb.matches[j].worker);
        cr_assert_eq(ra.tiers[j].host_blocks, rb.tiers[j].host_blocks);
        cr_assert_eq(ra.tiers[j].disk_blocks, rb.tiers[j].disk_blocks);
        uint32_t w = ra.matches[j].worker;
        cr_assert_eq(ra.tiers[j].host_blocks, w % 3 == 1 ? ra.matches[j].depth : 0);
        cr_assert_eq(ra.tiers[j].disk_blocks, w % 3 == 2 ? ra.matches[j].depth : 0);
    }
    km_match_results_free(&ra);
    km_match_results_free(&rb);
    km_index_destroy(a);
    km_index_destroy(b);
}

/* ---- the feed: per-medium events -> best tier ----------------------------------------------------- */

typedef struct feed_fx {
    km_index *index;
    km_feed *feed;
    km_kv_decoder *dec;
    km_test_batch batch;
    uint64_t seq, now;
} feed_fx;

static void feed_send(feed_fx *f)
{
    size_t size;
    const void *p = km_test_batch_payload(&f->batch, &size);
    km_kv_batch kb;
    cr_assert_eq(km_kv_decode_payload(f->dec, p, size, &kb), KM_OK);
    cr_assert_eq(km_feed_live(f->feed, 0, f->seq++, &kb, f->now++), KM_OK);
    cr_assert_eq(km_feed_flush(f->feed, f->now++, NULL), KM_OK, "%s", km_feed_last_error(f->feed));
    km_test_batch_reset(&f->batch);
}

static void expect_tiers(feed_fx *f, const uint64_t *chains, uint32_t n, const int *want)
{
    for (uint32_t i = 0; i < n; i++) {
        km_tier t = KM_TIER_DEVICE;
        int rc = km_index_pair_tier(f->index, chains[i], 0, &t);
        if (want[i] < 0)
            cr_assert_eq(rc, KM_ERR_NOT_FOUND, "block %u should be gone (rc %d)", i, rc);
        else
            cr_assert(rc == KM_OK && (int)t == want[i], "block %u: rc %d tier %d, want %d", i, rc,
                      (int)t, want[i]);
    }
}

Test(tiers, feed_media_to_best_tier, .timeout = 30)
{
    feed_fx f = {0};
    f.index = km_test_make_index(4);
    km_feed_config cfg;
    km_test_feed_config(&cfg, 4);
    cr_assert_eq(km_feed_create(f.index, &cfg, &f.feed), KM_OK);
    cr_assert_eq(km_kv_decoder_create(NULL, &f.dec), KM_OK);
    km_feed_worker_config wc = {0, "w0", false};
    cr_assert_eq(km_feed_add_worker(f.feed, &wc, f.now++), KM_OK);
    km_test_batch_init(&f.batch, KM_TEST_ENCODING_MAP, KM_TEST_HASH_INT, 0);

    uint32_t tokens[4 * 4];
    for (uint32_t i = 0; i < 16; i++)
        tokens[i] = 1000 + i;
    uint64_t engine[4] = {11, 12, 13, 14};
    uint64_t chains[4];
    km_hash_config hc = {4, NULL, NULL};
    size_t nb = 0;
    cr_assert_eq(km_hash_sequence(&hc, tokens, 16, 0, KM_NO_PARENT, NULL, chains, &nb), KM_OK);

    /* Stored on GPU; then copies of blocks 0..2 offloaded to CPU, 0..1 to disk: still device. */
    km_test_batch_stored(&f.batch, engine, 4, false, 0, tokens, 4, NULL, "GPU");
    feed_send(&f);
    km_test_batch_stored(&f.batch, engine, 3, false, 0, tokens, 4, NULL, "CPU");
    km_test_batch_stored(&f.batch, engine, 2, false, 0, tokens, 4, NULL, "DISK");
    feed_send(&f);
    expect_tiers(&f, chains, 4, (const int[]){0, 0, 0, 0});
    /* GPU evicts blocks 0..3: block 0, 1 fall to host (CPU beats disk), 2 to host, 3 is gone. */
    km_test_batch_removed(&f.batch, engine, 4, "GPU");
    feed_send(&f);
    expect_tiers(&f, chains, 4, (const int[]){1, 1, 1, -1});
    /* CPU drops 0 and 2: block 0 falls to disk, block 2 is gone. */
    uint64_t drop[2] = {11, 13};
    km_test_batch_removed(&f.batch, drop, 2, "cpu");
    feed_send(&f);
    expect_tiers(&f, chains, 4, (const int[]){2, 1, -1, -1});
    /* Block 0 loaded back onto the GPU: device again. */
    km_test_batch_stored(&f.batch, engine, 1, false, 0, tokens, 4, NULL, NULL);
    feed_send(&f);
    expect_tiers(&f, chains, 4, (const int[]){0, 1, -1, -1});
    /* Scoring splits the prefix: depth 2 = 1 device + 1 host. */
    km_request rq = {chains, 4};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(f.index, &rq, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].count, 1);
    cr_assert_eq(res.matches[0].depth, 2);
    cr_assert_eq(res.tiers[0].host_blocks, 1);
    cr_assert_eq(res.tiers[0].disk_blocks, 0);
    km_match_results_free(&res);
    /* AllBlocksCleared drops every tier. */
    km_test_batch_cleared(&f.batch);
    feed_send(&f);
    km_index_stats is;
    km_index_get_stats(f.index, &is);
    cr_assert_eq(is.pairs + is.host_pairs + is.disk_pairs, 0);

    km_test_batch_free(&f.batch);
    km_kv_decoder_destroy(f.dec);
    km_feed_destroy(f.feed);
    km_index_destroy(f.index);
}
