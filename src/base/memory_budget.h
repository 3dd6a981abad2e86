/* SPDX-License-Identifier: Apache-2.0 */
/* Memory accounting against a cap: every table and map of one owner (an index, the active-work
 * table, approximate mode, ...) charges its arrays to one km_memory, so the owner's total stays
 * within its cap and a refused growth is an error code, not an allocation failure later. Plain
 * counters: the owner serialises calls, as it does for the structures they account. */
#ifndef KM_MEMORY_BUDGET_H
#define KM_MEMORY_BUDGET_H

#include <stdint.h>

/* Bytes in use and the cap; zero-initialise (or {0, cap}). cap 0 = unlimited. */
typedef struct km_memory {
    uint64_t used;
    uint64_t cap;
} km_memory;

/* Replace an accounted size: an array of old_bytes becomes one of new_bytes. Growing past the cap
 * returns KM_ERR_MEMORY_CAP and changes nothing; shrinking always succeeds, so undoing a reserve
 * is the same call with the sizes swapped. */
int km_memory_reserve(km_memory *m, uint64_t old_bytes, uint64_t new_bytes);
/* Stop accounting `bytes` (an array freed). */
void km_memory_release(km_memory *m, uint64_t bytes);

#endif
