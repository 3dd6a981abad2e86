/* SPDX-License-Identifier: Apache-2.0 */
/* km_array_grow (src/base/array.h): doubling from the minimum, content kept, no change when there
 * is room, and a size that would overflow refused before anything is allocated. */
#include <stdint.h>
#include <stdlib.h>

#include <criterion/criterion.h>

#include "base/array.h"
#include "kvmatch/error.h"

Test(array, grows_by_doubling_and_keeps_the_content)
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

Test(array, a_size_past_size_max_is_refused_and_changes_nothing)
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
