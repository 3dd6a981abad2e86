/* SPDX-License-Identifier: Apache-2.0 */
/* Growable arrays (contract in array.h). */
#include "base/array.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"

int km_array_grow(void *array_ptr, size_t *capacity, size_t need, size_t elem_size,
                  size_t min_capacity)
{
    if (need <= *capacity)
        return KM_OK;
    size_t grown = *capacity > min_capacity ? *capacity : min_capacity;
    if (grown == 0)
        grown = 1;
    while (grown < need)
        grown = grown > SIZE_MAX / 2 ? need : grown * 2;
    if (elem_size && grown > SIZE_MAX / elem_size)
        return KM_ERR_OUT_OF_MEMORY;
    void *array;
    memcpy(&array, array_ptr, sizeof array);
    void *moved = realloc(array, grown * elem_size);
    if (!moved)
        return KM_ERR_OUT_OF_MEMORY;
    memcpy(array_ptr, &moved, sizeof moved);
    *capacity = grown;
    return KM_OK;
}
