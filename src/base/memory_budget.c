/* SPDX-License-Identifier: Apache-2.0 */
/* Memory accounting against a cap (contract in memory_budget.h). */
#include "base/memory_budget.h"

#include "kvmatch/error.h"

int km_memory_reserve(km_memory *m, uint64_t old_bytes, uint64_t new_bytes)
{
    if (new_bytes > old_bytes && m->cap && m->used - old_bytes + new_bytes > m->cap)
        return KM_ERR_MEMORY_CAP;
    m->used = m->used - old_bytes + new_bytes;
    return KM_OK;
}

void km_memory_release(km_memory *m, uint64_t bytes)
{
    m->used -= bytes;
}
