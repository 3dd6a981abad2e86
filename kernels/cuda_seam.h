/* SPDX-License-Identifier: Apache-2.0 */
/* The C-linkage seam between the CUDA backend's vtable (kernels/cuda_backend.c, C11) and its device
 * code (kernels/cuda_kernels.cu, CUDA C++). Only plain C types cross it: no cudaStream_t, no
 * cuda_runtime.h, no <<<>>>. Every function returns KM_OK or a negative km_status; a CUDA runtime
 * failure is KM_ERR_CUDA with the detail (call, cudaGetErrorString, source line) kept for
 * km_cuda_last_error(), except device or pinned memory exhausted, which is KM_ERR_OUT_OF_MEMORY
 * (not sticky: a replica it left half written is uploaded whole by the next sync). Nothing here
 * aborts or exits. Every call that touches the device makes
 * the handle's device current on the calling thread first (cudaSetDevice) and leaves it current.
 *
 * The device side holds a replica of the index's two host tables (src/index/host_table.h) in cudaMalloc memory,
 * same slot layout and bitmap pool, plus one stream, pinned staging buffers and scoring scratch.
 * Scoring runs km_warp_walk_request (src/index/warp_walk.h), one warp per request, on the replica,
 * so results are bit-identical to the CPU backend's as long as the replica equals the host tables. */
#ifndef KM_CUDA_SEAM_H
#define KM_CUDA_SEAM_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/index.h"
#include "index/slot_walk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_cuda km_cuda; /* opaque: device, stream, replicas, buffers */

/* Which replica a table update is for. */
typedef enum km_cuda_table_id {
    KM_CUDA_TABLE_BLOCKS = 0,
    KM_CUDA_TABLE_SEGMENTS = 1,
} km_cuda_table_id;
#define KM_CUDA_TABLE_COUNT 2

/* One host table as the replica needs it: the current slots and pool, and what changed since the
 * replica was last made equal to it. The slot and bitmap contents are read at the time of the call
 * (so an index listed twice carries the same bytes twice: the order of writes cannot matter). */
typedef struct km_cuda_table_source {
    const km_slot *slots;   /* capacity slots */
    uint64_t capacity;      /* slots, any size >= 1 (km_slot_home) */
    uint32_t words_per_set; /* u64 words per bitmap */
    const uint64_t *pool;   /* pool_capacity bitmaps; the first pool_used are the ones ever written */
    uint32_t pool_capacity;
    uint32_t pool_used;
    /* Upload everything (the host reallocated slots or pool, or the replica is new). */
    int full;
    const uint64_t *dirty_slots; /* slot indices written since the last sync, repeats allowed */
    size_t n_dirty_slots;
    const uint32_t *dirty_sets; /* bitmap indices written since the last sync, repeats allowed */
    size_t n_dirty_sets;
} km_cuda_table_source;

/* Open device `device`: check it exists and runs this build's kernels (a probe launch), create the
 * stream and events. KM_ERR_BACKEND_UNAVAILABLE with a reason in why when there is no usable device;
 * KM_ERR_CUDA / KM_ERR_OUT_OF_MEMORY when setting up on a usable one failed. On success why gets
 * km_cuda_describe()'s line. The replicas start empty: upload both tables with
 * km_cuda_sync_table(full = 1) before scoring. */
int km_cuda_create(int device, km_cuda **out, char *why, size_t why_size);
/* Free everything (device memory, pinned memory, stream, events); NULL is a no-op. Never fails:
 * errors of a context already broken are ignored. */
void km_cuda_destroy(km_cuda *cuda);
/* "NVIDIA H200 (device 0, sm_90, 132 SMs, 139.8 GiB)": one line for the backend-choice log. */
const char *km_cuda_describe(const km_cuda *cuda);
/* Detail of the last KM_ERR_CUDA (or other failure) on this state; "" when none. */
const char *km_cuda_last_error(const km_cuda *cuda);

/* Make one replica equal to its host table: reallocate and upload whole when src->full or the
 * capacity or pool size differs from the replica, else patch the dirty slots and bitmaps (each
 * destination staged once by the host, so one writer per destination on the device). The device work may still be running
 * when this returns; it is ordered before every later scoring call. The host may change the table
 * as soon as this returns. */
int km_cuda_sync_table(km_cuda *cuda, km_cuda_table_id table, const km_cuda_table_source *src);

/* Scoring parameters; reserve is km_match_results_reserve (src/index/index_internal.h), passed in so the
 * C compiler checks its type and the device code needs no index internals. It must keep the
 * buffers' contents when it grows them (it reallocates): matches are appended chunk by chunk. */
typedef struct km_cuda_match_args {
    uint32_t max_workers;
    uint32_t segment_blocks;
    int (*reserve)(km_match_results *results, size_t n_requests, size_t n_matches);
    /* The host copies (packing the hashes into pinned staging, the results out of it) run as
     * parts on the caller's threads: for_each(for_each_ctx, n_parts, part, arg) calls
     * part(arg, i) once for every i in [0, n_parts) and returns when all have returned. NULL runs
     * them in order on the calling thread. */
    void (*for_each)(void *for_each_ctx, size_t n_parts, void (*part)(void *arg, size_t i),
                     void *arg);
    void *for_each_ctx;
} km_cuda_match_args;

/* Score n requests on the replicas into results: results->requests[0..n) (first, count, owner,
 * owner_depth, probes), results->matches[0..n_matches) ascending by worker within each request,
 * results->n_requests, n_matches and probes; exactly what km_walk_request gives on the host.
 * Requests are validated by the caller (n_hashes <= max_request_blocks, hashes non-NULL when
 * n_hashes > 0); a NULL hashes with n_hashes > 0 still returns KM_ERR_NULL_POINTER here. */
int km_cuda_match(km_cuda *cuda, const km_cuda_match_args *args, const km_request *requests,
                  size_t n, km_match_results *results);

#ifdef __cplusplus
}
#endif
#endif
