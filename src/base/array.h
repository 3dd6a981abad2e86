/* SPDX-License-Identifier: Apache-2.0 */
/* Growable arrays: the one helper behind every "make room for n elements, doubling" in kvmatch,
 * with the overflow checks a hand-written copy tends to leave out. */
#ifndef KM_ARRAY_H
#define KM_ARRAY_H

#include <stddef.h>

#include "kvmatch/error.h"

/* Make the array whose address is array_ptr (a T **, holding *capacity elements of elem_size
 * bytes) hold at least `need` elements: the capacity doubles, from min_capacity when it was
 * smaller, until it does. KM_OK, at once when need <= *capacity; KM_ERR_OUT_OF_MEMORY when the
 * allocation fails or its size in bytes would not fit in a size_t, and then the array and
 * *capacity are unchanged. Elements past the old capacity are uninitialised. The pointer is read
 * and written with memcpy, so one function serves every element type. */
int km_array_grow(void *array_ptr, size_t *capacity, size_t need, size_t elem_size,
                  size_t min_capacity);

/* km_array_grow with the common case, room already there, decided without a call. */
static inline int km_array_reserve(void *array_ptr, size_t *capacity, size_t need,
                                   size_t elem_size, size_t min_capacity)
{
    return need <= *capacity ? KM_OK
                             : km_array_grow(array_ptr, capacity, need, elem_size, min_capacity);
}

/* km_array_grow on an array lvalue `array` (a T *) and its size_t `capacity`. */
#define KM_ARRAY_GROW(array, capacity, need, min_capacity) \
    km_array_reserve(&(array), &(capacity), (need), sizeof *(array), (min_capacity))

#endif
