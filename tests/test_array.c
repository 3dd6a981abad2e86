/* SPDX-License-Identifier: Apache-2.0 */
/* km_array_grow (src/base/array.h): doubling from the minimum, content kept, no change when there
 * is room, and a size that would overflow refused before anything is allocated. km_pages_grow
 * (src/base/zeroed_pages.h): content kept and the new part zero across every size transition. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "base/array.h"
#include "base/zeroed_pages.h"
#include "kvmatch/error.h"

Test(array, grows_by_doubling_and_keeps_the_content, .timeout = 30)
{
    uint32_t *a = NULL;
    size_t capacity = 0;
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 0, 16), KM_OK);
    cr_assert(a == NULL && capacity == 0, "need 0 allocates nothing");
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 1, 16), KM_OK);
    cr_assert_eq(capacity, 16);
    for (uint32_t i = 0; i < 16; i++)
        a[i] = i * 7;
    uint32_t *before = a;
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 16, 16), KM_OK);
    cr_assert(a == before && capacity == 16, "room enough: nothing changes");
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 17, 16), KM_OK);
    cr_assert_eq(capacity, 32);
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 200, 16), KM_OK);
    cr_assert_eq(capacity, 256, "doubles until it holds the need: %zu", capacity);
    for (uint32_t i = 0; i < 16; i++)
        cr_assert_eq(a[i], i * 7);
    free(a);

    char *c = NULL;
    size_t c_capacity = 0;
    cr_assert_eq(KM_ARRAY_GROW(c, c_capacity, 3, 0), KM_OK);
    cr_assert_eq(c_capacity, 4, "minimum 0 starts from 1: %zu", c_capacity);
    free(c);
}

Test(array, a_size_past_size_max_is_refused_and_changes_nothing, .timeout = 30)
{
    uint64_t *a = NULL;
    size_t capacity = 0;
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, 4, 4), KM_OK);
    a[3] = 42;
    uint64_t *before = a;
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, SIZE_MAX / 4, 4), KM_ERR_OUT_OF_MEMORY);
    cr_assert_eq(KM_ARRAY_GROW(a, capacity, SIZE_MAX, 4), KM_ERR_OUT_OF_MEMORY);
    cr_assert(a == before && capacity == 4 && a[3] == 42, "a refused growth changes nothing");
    free(a);
}

/* Doubling from a few bytes to several pieces: every step keeps what was written (a pattern over
 * the whole array, so a lost or shifted page shows) and hands out the new part zeroed; mapped
 * arrays stay on a piece boundary, so their pieces can still be given back. */
Test(array, pages_grow_keeps_the_content_and_zeroes_the_rest, .timeout = 30)
{
    uint64_t bytes = 24;
    uint8_t *p = km_pages_grow(NULL, 0, bytes);
    cr_assert_not_null(p);
    for (uint64_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)(i * 131 + 7);
    while (bytes < 5 * KM_PAGES_PIECE) {
        uint64_t next = bytes * 2 + 8;
        uint8_t *q = km_pages_grow(p, bytes, next);
        cr_assert_not_null(q, "%llu -> %llu bytes", (unsigned long long)bytes,
                           (unsigned long long)next);
        for (uint64_t i = 0; i < bytes; i++)
            if (q[i] != (uint8_t)(i * 131 + 7))
                cr_assert_fail("%llu -> %llu bytes: byte %llu changed",
                               (unsigned long long)bytes, (unsigned long long)next,
                               (unsigned long long)i);
        for (uint64_t i = bytes; i < next; i++)
            if (q[i] != 0)
                cr_assert_fail("%llu -> %llu bytes: new byte %llu is not zero",
                               (unsigned long long)bytes, (unsigned long long)next,
                               (unsigned long long)i);
        if (next >= KM_PAGES_PIECE)
            cr_assert_eq((uintptr_t)q % KM_PAGES_PIECE, 0, "a mapped array starts on a piece");
        for (uint64_t i = bytes; i < next; i++)
            q[i] = (uint8_t)(i * 131 + 7);
        p = q;
        bytes = next;
    }
    cr_assert_eq(km_pages_grow(p, bytes, bytes), p, "no growth: the same array");
    km_pages_release(p, bytes, 0, KM_PAGES_PIECE);
    cr_assert_eq(p[KM_PAGES_PIECE], (uint8_t)(KM_PAGES_PIECE * 131 + 7), "the rest stays");
    km_pages_release(p, bytes, KM_PAGES_PIECE, bytes);
}

/* An array of a size that is not a whole number of pages keeps no more than its own pages: the
 * over-mapped piece that aligns it is trimmed from the page after its last one, so that page is
 * not mapped (nothing else is mapped between the allocation and the look). */
static uint64_t mapped_bytes_in(uintptr_t from, uintptr_t to)
{
    FILE *f = fopen("/proc/self/maps", "r");
    cr_assert_not_null(f);
    char line[512];
    uint64_t total = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) != 2)
            continue;
        uintptr_t a = lo > from ? lo : from, b = hi < to ? hi : to;
        if (a < b)
            total += b - a;
    }
    fclose(f);
    return total;
}

Test(array, pages_of_an_odd_size_keep_no_tail_mapped, .timeout = 10)
{
    const uint64_t page = 4096;
    const uint64_t sizes[3] = {KM_PAGES_PIECE + 100, 3 * KM_PAGES_PIECE + 4095,
                               5 * KM_PAGES_PIECE + 7 * 333};
    for (int k = 0; k < 3; k++) {
        uint8_t *p = km_pages_alloc(sizes[k]);
        cr_assert_not_null(p);
        uintptr_t end = (uintptr_t)p + (sizes[k] + page - 1) / page * page;
        cr_assert_eq(mapped_bytes_in((uintptr_t)p, end), end - (uintptr_t)p, "the array itself");
        cr_assert_eq(mapped_bytes_in(end, end + page), 0,
                     "size %" PRIu64 ": the page after the array is still mapped", sizes[k]);
        p[sizes[k] - 1] = 1;
        km_pages_free(p, sizes[k]);
        cr_assert_eq(mapped_bytes_in((uintptr_t)p, end), 0, "size %" PRIu64 ": not freed",
                     sizes[k]);
    }
}

/* A size no mapping can hold (within a page or a piece of 2^64, where rounding it up would wrap
 * to a few bytes) is refused: never a small array handed out for a huge one. */
Test(array, pages_of_a_size_that_would_wrap_are_refused, .timeout = 10)
{
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t sizes[] = {UINT64_MAX, UINT64_MAX - page + 2, UINT64_MAX - KM_PAGES_PIECE + 1,
                              UINT64_MAX - 2 * KM_PAGES_PIECE, UINT64_C(1) << 63};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        cr_assert_null(km_pages_alloc(sizes[i]), "%#llx bytes were handed out",
                       (unsigned long long)sizes[i]);
        cr_assert_null(km_pages_grow(NULL, 0, sizes[i]));
    }
    uint8_t *p = km_pages_alloc(KM_PAGES_PIECE);
    cr_assert_not_null(p);
    p[0] = 7;
    cr_assert_null(km_pages_grow(p, KM_PAGES_PIECE, UINT64_MAX - 100), "a wrapped growth succeeded");
    cr_assert_eq(p[0], 7, "a refused growth changed the array");
    km_pages_free(p, KM_PAGES_PIECE);
}
