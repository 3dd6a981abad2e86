/* SPDX-License-Identifier: Apache-2.0 */
/* The undo log of km_index_apply (src/index/index.c, "undo log") is the index's own and is reused:
 * a stream of large batches keeps one log instead of growing, copying and faulting in a fresh one
 * each time; the first batch that fills less than a quarter of a large log gives it back; a batch
 * with no store logs nothing. The index's content stays exact throughout (checked against the
 * oracle of tests/test_util.c). */
#include <inttypes.h>
#include <stdlib.h>

#include "index/index_internal.h"
#include "test_util.h"

/* Fill h with a chain of n fresh block hashes (never the reserved values 0 and 1). */
static void fresh_chain(km_rng *r, uint64_t *h, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h[i] = km_rng_hash(r);
}

static void apply_checked(km_index *index, km_oracle *o, const km_update *u, size_t n)
{
    km_update_stats got, expect;
    cr_assert_eq(km_index_apply(index, u, n, &got), KM_OK, "%s", km_index_last_error(index));
    km_oracle_apply(o, u, n, &expect);
    char why[256];
    cr_assert(km_update_stats_equal(&got, &expect, why, sizeof why), "%s", why);
    cr_assert(km_check_counters(o, index, why, sizeof why), "%s", why);
}

Test(update_log, large_batches_reuse_one_log_and_a_small_one_gives_it_back, .timeout = 60)
{
    km_index *index = km_test_growing_index(8, 4, 1);
    km_oracle o;
    km_oracle_init(&o, 8);
    km_rng r;
    km_rng_init(&r, km_test_seed());

    /* Each stored block logs at least one entry, so a batch of this many blocks passes the size
     * below which a log is always kept. */
    enum { BLOCKS = 200000 };
    uint64_t *h = malloc(BLOCKS * sizeof *h);
    cr_assert_not_null(h);
    fresh_chain(&r, h, BLOCKS);
    km_update store0 = {KM_UPDATE_STORE, 0, KM_NO_PARENT, h, BLOCKS, KM_TIER_DEVICE};
    apply_checked(index, &o, &store0, 1);
    size_t kept_capacity = index->undo_capacity;
    const void *kept_log = index->undo_log;
    cr_assert(kept_capacity > (size_t)1 << 16 && kept_log != NULL,
              "a large batch keeps its log for the next one (capacity %zu)", kept_capacity);

    /* The same work again for other workers: the log is reused as it is. */
    for (uint32_t w = 1; w < 4; w++) {
        km_update store = {KM_UPDATE_STORE, w, KM_NO_PARENT, h, BLOCKS, KM_TIER_DEVICE};
        apply_checked(index, &o, &store, 1);
        cr_assert(index->undo_log == kept_log && index->undo_capacity == kept_capacity,
                  "batch for worker %u: log %p capacity %zu, expected the kept %p / %zu", w,
                  (void *)index->undo_log, index->undo_capacity, kept_log, kept_capacity);
    }

    /* Removes log nothing (a batch without a store cannot fail half way): the log stays. */
    km_update remove3 = {KM_UPDATE_REMOVE, 3, KM_NO_PARENT, h, BLOCKS, KM_TIER_DEVICE};
    apply_checked(index, &o, &remove3, 1);
    cr_assert_eq(index->undo_capacity, kept_capacity);

    /* A small store batch fills far less than a quarter of it: the log is given back. */
    uint64_t one[1];
    fresh_chain(&r, one, 1);
    km_update small = {KM_UPDATE_STORE, 5, KM_NO_PARENT, one, 1, KM_TIER_DEVICE};
    apply_checked(index, &o, &small, 1);
    cr_assert(index->undo_log == NULL && index->undo_capacity == 0,
              "a small batch after large ones gives the large log back (capacity %zu)",
              index->undo_capacity);

    /* Small logs are kept whatever the batch after them uses. */
    fresh_chain(&r, h, 5000);
    km_update medium = {KM_UPDATE_STORE, 6, KM_NO_PARENT, h, 5000, KM_TIER_DEVICE};
    apply_checked(index, &o, &medium, 1);
    size_t small_capacity = index->undo_capacity;
    cr_assert(small_capacity > 0 && small_capacity <= (size_t)1 << 16, "capacity %zu",
              small_capacity);
    fresh_chain(&r, one, 1);
    km_update tiny = {KM_UPDATE_STORE, 7, KM_NO_PARENT, one, 1, KM_TIER_DEVICE};
    apply_checked(index, &o, &tiny, 1);
    cr_assert_eq(index->undo_capacity, small_capacity);

    free(h);
    km_oracle_free(&o);
    km_index_destroy(index);
}
