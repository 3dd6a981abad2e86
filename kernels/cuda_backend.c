/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's vtable: a thin C11 layer over the C-linkage seam (kernels/cuda_seam.h). It
 * describes the index's host tables to the device side (whole at create or after a reallocation,
 * else their dirty-slot lists) and forwards scoring batches; all CUDA work and every CUDA type stay
 * in kernels/. Errors come back as km_status codes with their detail in the index's last-error
 * message; on any but KM_ERR_OUT_OF_MEMORY the index moves to the CPU backend. Built only with
 * KM_HAVE_CUDA. */
#include <stdio.h>
#include <stdlib.h>

#include "index/index_internal.h"
#include "index/thread_pool.h"
#include "cuda_seam.h"

/* The device side and the host threads that pack each batch's hashes and move its results. */
typedef struct cuda_backend {
    km_cuda *cuda;
    km_thread_pool *pool; /* NULL when single-threaded */
} cuda_backend;

/* How the replica of one host table is brought up to date. `full` forces a whole upload (create);
 * the table's own layout_changed forces one after a resize, rehash or pool growth. */
static km_cuda_table_source km_cuda_source_of(const km_table *t, int full)
{
    km_cuda_table_source src = {
        .slots = t->slots,
        .capacity = t->capacity,
        .words_per_set = t->words_per_set,
        .pool = t->pool,
        .pool_capacity = t->pool_capacity,
        .pool_used = t->pool_high,
        .full = full || t->layout_changed,
        .dirty_slots = t->dirty_slots,
        .n_dirty_slots = t->n_dirty_slots,
        .dirty_sets = t->dirty_sets,
        .n_dirty_sets = t->n_dirty_sets,
    };
    return src;
}

/* Bring both replicas up to date; on failure *which names the table. */
static int km_cuda_sync_both(km_cuda *cuda, km_index *index, int full, const char **which)
{
    km_cuda_table_source blocks = km_cuda_source_of(&index->blocks, full);
    *which = "block table";
    int rc = km_cuda_sync_table(cuda, KM_CUDA_TABLE_BLOCKS, &blocks);
    if (rc != KM_OK)
        return rc;
    km_cuda_table_source segments = km_cuda_source_of(&index->segments, full);
    *which = "segment table";
    return km_cuda_sync_table(cuda, KM_CUDA_TABLE_SEGMENTS, &segments);
}

static void km_cuda_backend_destroy(void *state)
{
    cuda_backend *backend = state;
    if (!backend)
        return;
    km_cuda_destroy(backend->cuda);
    km_thread_pool_destroy(backend->pool);
    free(backend);
}

/* Open the device and upload both tables whole, and start the host threads (config.threads in
 * all, the caller's included). On success `why` holds the device's description ("NVIDIA H200
 * (device 0, sm_90, ...)") for the backend-choice log line. */
static int km_cuda_backend_create(km_index *index, void **state, char *why, size_t why_size)
{
    *state = NULL;
    cuda_backend *backend = calloc(1, sizeof *backend);
    if (!backend) {
        snprintf(why, why_size, "CUDA backend: out of host memory");
        return KM_ERR_OUT_OF_MEMORY;
    }
    int rc = km_cuda_create(index->config.cuda_device, &backend->cuda, why, why_size);
    if (rc != KM_OK) {
        free(backend);
        return rc;
    }
    const char *which = "";
    rc = km_cuda_sync_both(backend->cuda, index, 1, &which);
    if (rc != KM_OK) {
        snprintf(why, why_size, "%s: uploading the %s: %s", km_cuda_describe(backend->cuda), which,
                 km_cuda_last_error(backend->cuda));
        km_cuda_backend_destroy(backend);
        return rc;
    }
    uint32_t threads = index->config.threads ? index->config.threads : 1;
    if (threads > 1) {
        backend->pool = km_thread_pool_create(threads - 1, "km-cuda-host");
        if (!backend->pool) {
            snprintf(why, why_size, "CUDA backend: starting %u host threads", threads - 1);
            km_cuda_backend_destroy(backend);
            return KM_ERR_OUT_OF_MEMORY;
        }
    }
    *state = backend;
    return KM_OK;
}

static int km_cuda_backend_sync(void *state, km_index *index)
{
    cuda_backend *backend = state;
    const char *which = "";
    int rc = km_cuda_sync_both(backend->cuda, index, 0, &which);
    if (rc != KM_OK)
        return km_index_fail(index, rc, "CUDA backend: updating the device %s: %s", which,
                             km_cuda_last_error(backend->cuda));
    return KM_OK;
}

static void km_cuda_backend_for_each(void *pool, size_t n_parts, void (*part)(void *arg, size_t i),
                                     void *arg)
{
    km_thread_pool_for_each(pool, n_parts, part, arg);
}

static int km_cuda_backend_match(void *state, km_index *index, const km_request *requests,
                                 size_t n, km_match_results *results)
{
    cuda_backend *backend = state;
    km_cuda_match_args args = {
        .max_workers = index->config.max_workers,
        .segment_blocks = index->config.segment_blocks,
        .reserve = km_match_results_reserve,
        .for_each = km_cuda_backend_for_each,
        .for_each_ctx = backend->pool,
    };
    int rc = km_cuda_match(backend->cuda, &args, requests, n, results);
    if (rc != KM_OK)
        return km_index_fail(index, rc, "CUDA backend: scoring %zu requests: %s", n,
                             km_cuda_last_error(backend->cuda));
    return KM_OK;
}

const km_backend_ops km_backend_cuda = {
    .name = "cuda",
    .create = km_cuda_backend_create,
    .destroy = km_cuda_backend_destroy,
    .sync = km_cuda_backend_sync,
    .match = km_cuda_backend_match,
    .needs_dirty_tracking = 1,
};
