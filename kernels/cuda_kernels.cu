/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's device side: a replica of the index's two host tables in device memory, kept
 * equal to them by patches of dirty slots and bitmaps, and batched scoring of requests on it, one
 * warp per request, with the warp walk (src/index/warp_walk.h) whose results are bit-identical to
 * the CPU backend's (tests/test_warp_walk.c runs it under a host warp emulation). Reached only
 * through the C-linkage seam in kernels/cuda_seam.h.
 *
 * Shape of the file (a thin C-linkage seam): `static __global__` kernels, each with a
 * `static` launcher that takes a cudaStream_t, computes the grid and returns the launch status;
 * `extern "C"` entry points with plain C types that return a km_status. Every CUDA call is checked;
 * a failure becomes KM_ERR_CUDA with the detail in km_cuda_last_error() (never an abort), and the
 * index then moves to the CPU backend; device or pinned memory exhausted is KM_ERR_OUT_OF_MEMORY
 * (not sticky: the index scores on the host meanwhile).
 *
 * Ordering: all device work runs on one stream. Pinned staging buffers are rewritten by the host
 * only after the copies and kernels that read them are known complete (an event per sync staging
 * buffer; for the scoring staging, each chunk waits for its last copy back before it returns).
 * Device buffers are only freed or regrown after the stream is drained (km_cuda_device_reserve). */
#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>

#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_seam.h"
#include "index/warp_walk.h"
#include "kvmatch/error.h"

/* The device writes km_walk_entry; the host reads km_worker_match: the same bytes. */
static_assert(sizeof(km_walk_entry) == sizeof(km_worker_match), "walk entry / worker match size");
static_assert(offsetof(km_walk_entry, worker) == offsetof(km_worker_match, worker), "worker field");
static_assert(offsetof(km_walk_entry, depth) == offsetof(km_worker_match, depth), "depth field");
static_assert(sizeof(km_slot) == 16 && alignof(km_slot) == 16, "slot layout");

/* ---- tunables ---------------------------------------------------------------------------------
 * Scoring runs in chunks so that per-request scratch (max_workers walk entries, as many compacted
 * ones, and the walk's KM_WALK_SCRATCH_WORDS scratch words, in global memory) stays bounded: at
 * most KM_CUDA_MATCH_CHUNK requests per launch and at most KM_CUDA_SCRATCH_BUDGET bytes of scratch
 * (max_workers = 65534: 1,335,256 bytes per request, 201 requests per chunk).
 * A chunk stages at most KM_CUDA_HASH_BUDGET hashes, except that a single longer request is always
 * accepted alone (max_request_blocks bounds it). */
#define KM_CUDA_MATCH_CHUNK 8192u
#define KM_CUDA_SCRATCH_BUDGET ((size_t)256 << 20)
#define KM_CUDA_HASH_BUDGET ((uint64_t)1 << 22)
/* Pinned staging for one round of dirty-slot or dirty-bitmap patches; longer dirty lists are sent
 * in several rounds (each carries current contents, so rounds commute). There are two such
 * buffers, used in turn, so the host fills one while the previous round's copy reads the other. */
#define KM_CUDA_SYNC_ROUND_BYTES ((size_t)32 << 20)
/* Scoring: one warp per request (src/index/warp_walk.h), KM_CUDA_WALK_WARPS warps per block (1,000
 * requests: 250 blocks, every multiprocessor of an H100/H200 busy). A warp's walk scratch lives in
 * shared memory when the block's fits in KM_CUDA_WALK_SHARED_BYTES (up to 2,800 workers), else in
 * its row of global scratch. */
#define KM_CUDA_WALK_WARPS 4u
#define KM_CUDA_WALK_SHARED_BYTES ((size_t)48 << 10)
#define KM_CUDA_COPY_THREADS 256u
/* Host copies of a scoring chunk. The caller's threads pack the hashes into mapped pinned memory,
 * KM_CUDA_STAGE_PART_REQUESTS requests at a time, and the walk reads them from there over the bus:
 * it reads only block 0, the segment keys, the tail and the blocks of the segments where workers
 * drop out, a small part of a long request's hashes, so nothing copies the rest. The results come
 * back into pinned memory in as many pieces of about KM_CUDA_RESULT_PIECE_MIN bytes as they fill,
 * one at least and KM_CUDA_RESULT_PIECES at most, all queued at once; the host moves each piece
 * that has arrived into the caller's results (KM_CUDA_RESULT_PART_BYTES per part) while the later
 * ones are on the bus. */
#define KM_CUDA_STAGE_PART_REQUESTS 16u
#define KM_CUDA_RESULT_PIECES 4u
#define KM_CUDA_RESULT_PIECE_MIN ((size_t)512 << 10)
#define KM_CUDA_RESULT_PART_BYTES ((size_t)64 << 10)
#define KM_CUDA_MAX_GRID 65535u /* grid-stride loops cover anything beyond */

/* ---- state ------------------------------------------------------------------------------------ */

typedef struct km_cuda_replica {
    km_slot *slots;         /* capacity slots, device */
    uint64_t capacity;      /* 0 until the first upload */
    uint32_t words_per_set;
    uint64_t *pool;         /* pool_capacity * words_per_set words, device; NULL when empty */
    uint32_t pool_capacity;
    int valid;              /* equal to the host table as of the last successful sync */
} km_cuda_replica;

/* A grow-only buffer, device or pinned host. */
typedef struct km_cuda_buffer {
    void *ptr;
    size_t bytes;
    void *device_view; /* pinned and mapped: the device's address of ptr; else NULL */
} km_cuda_buffer;

struct km_cuda {
    int device;
    cudaStream_t stream;
    cudaEvent_t sync_staging_free[2]; /* recorded after the last copy out of sync_host[i] */
    cudaEvent_t results_arrived[KM_CUDA_RESULT_PIECES]; /* piece k is in matches_host */
    int sync_staging_pending[2];      /* the event was recorded and not waited for since */
    int sync_staging_next;            /* the buffer the next round fills */

    km_cuda_replica tables[KM_CUDA_TABLE_COUNT];

    /* sync: [payload (slots or bitmaps)][destination indices], pinned (two, in turn) and one
     * device mirror (the stream orders each round's copy after the previous round's scatter);
     * CUB temp storage for the scoring scan. */
    km_cuda_buffer sync_host[2], sync_dev, temp_dev;
    /* Host bitmap, one bit per slot or pool bitmap of the table being patched: which destinations
     * a patch has staged already, so each is sent once and written by one thread. All zero between
     * patches. */
    uint64_t *staged_bits;
    uint64_t staged_bits_capacity; /* bits */

    /* scoring: offsets (n+1 u64), pinned and device; packed hashes, pinned and mapped (the walk
     * reads them over the bus); per-request results (count, owner, owner_depth, probes: 4 arrays
     * of m u32) pinned and device (+ first: m u32); walk scratch; compacted entries, device and
     * their pinned landing place. */
    km_cuda_buffer offsets_host, offsets_dev, hashes_host, meta_host, meta_dev;
    km_cuda_buffer entries_dev, scratch_dev, compact_dev, matches_host;

    char description[192];
    char last_error[256];
};

/* ---- errors ----------------------------------------------------------------------------------- */

/* Record a CUDA failure: the runtime function's name (the text of the call up to its '('), the
 * runtime's sentence and error name, and the line. Clears the runtime's non-sticky error state so
 * the failure is not reported again by an unrelated later call. Device or pinned memory exhausted
 * (cudaErrorMemoryAllocation) is not sticky and leaves the context usable: it is
 * KM_ERR_OUT_OF_MEMORY, so the index scores on the host until a later sync succeeds instead of
 * leaving the device for good; every other failure is KM_ERR_CUDA. */
static int km_cuda_fail(km_cuda *c, cudaError_t e, const char *call, int line)
{
    const char *paren = strchr(call, '(');
    int name_len = paren ? (int)(paren - call) : (int)strlen(call);
    (void)cudaGetLastError();
    if (c)
        snprintf(c->last_error, sizeof c->last_error, "%.*s: %s [%s] (kernels/cuda_kernels.cu:%d)",
                 name_len, call, cudaGetErrorString(e), cudaGetErrorName(e), line);
    return e == cudaErrorMemoryAllocation ? KM_ERR_OUT_OF_MEMORY : KM_ERR_CUDA;
}

static int km_cuda_fail_status(km_cuda *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int km_cuda_fail_status(km_cuda *c, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof c->last_error, fmt, ap);
    va_end(ap);
    return status;
}

/* CHECK: a CUDA runtime call that must succeed; on failure record it and return KM_ERR_CUDA. */
#define KM_CUDA_CHECK(c, call)                                                                     \
    do {                                                                                           \
        cudaError_t km_cuda_e_ = (call);                                                           \
        if (km_cuda_e_ != cudaSuccess)                                                             \
            return km_cuda_fail((c), km_cuda_e_, #call, __LINE__);                                 \
    } while (0)
/* A km_status-returning step. */
#define KM_CHECK(call)                                                                             \
    do {                                                                                           \
        int km_rc_ = (call);                                                                       \
        if (km_rc_ != KM_OK)                                                                       \
            return km_rc_;                                                                         \
    } while (0)

/* ---- buffers ---------------------------------------------------------------------------------- */

/* Grow a device buffer to at least `bytes` (contents not kept). Drains the stream first: queued
 * work may still read the old buffer. Asks for 1.5x to amortise growth, then exactly `bytes`. */
static int km_cuda_device_reserve(km_cuda *c, km_cuda_buffer *b, size_t bytes)
{
    if (bytes <= b->bytes)
        return KM_OK;
    KM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
    if (b->ptr) {
        void *old = b->ptr;
        b->ptr = NULL;
        b->bytes = 0;
        KM_CUDA_CHECK(c, cudaFree(old));
    }
    size_t want = bytes + bytes / 2;
    if (want < bytes)
        want = bytes;
    if (cudaMalloc(&b->ptr, want) != cudaSuccess) {
        (void)cudaGetLastError(); /* out of memory is not sticky */
        b->ptr = NULL;
        want = bytes;
        KM_CUDA_CHECK(c, cudaMalloc(&b->ptr, want));
    }
    b->bytes = want;
    return KM_OK;
}

/* CUB temp storage for a call that asked for `bytes`. Never leaves the pointer NULL: CUB treats a
 * NULL temp pointer as a size query and would silently skip the work. */
static int km_cuda_temp_reserve(km_cuda *c, size_t bytes)
{
    return km_cuda_device_reserve(c, &c->temp_dev, bytes < 256 ? 256 : bytes);
}

static void km_cuda_buffer_free_pinned(km_cuda_buffer *b)
{
    if (b->ptr)
        (void)cudaFreeHost(b->ptr);
    b->ptr = NULL;
    b->bytes = 0;
    b->device_view = NULL;
}

/* Same for pinned host memory (cudaHostAlloc). Drains the stream: copies or kernels may still
 * read it. `mapped` also maps it into the device's address space (device_view). */
static int km_cuda_host_reserve(km_cuda *c, km_cuda_buffer *b, size_t bytes, int mapped)
{
    if (bytes <= b->bytes)
        return KM_OK;
    KM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
    c->sync_staging_pending[0] = c->sync_staging_pending[1] = 0; /* drained: events completed */
    if (b->ptr) {
        void *old = b->ptr;
        b->ptr = NULL;
        b->bytes = 0;
        b->device_view = NULL;
        KM_CUDA_CHECK(c, cudaFreeHost(old));
    }
    unsigned flags = mapped ? cudaHostAllocMapped : cudaHostAllocDefault;
    size_t want = bytes + bytes / 2;
    if (want < bytes)
        want = bytes;
    if (cudaHostAlloc(&b->ptr, want, flags) != cudaSuccess) {
        (void)cudaGetLastError();
        b->ptr = NULL;
        want = bytes;
        KM_CUDA_CHECK(c, cudaHostAlloc(&b->ptr, want, flags));
    }
    b->bytes = want;
    if (mapped) {
        cudaError_t e = cudaHostGetDevicePointer(&b->device_view, b->ptr, 0);
        if (e != cudaSuccess) { /* never keep a mapped buffer without its device address */
            km_cuda_buffer_free_pinned(b);
            return km_cuda_fail(c, e, "cudaHostGetDevicePointer(&b->device_view, b->ptr, 0)",
                                __LINE__);
        }
    }
    return KM_OK;
}

static int km_cuda_pinned_reserve(km_cuda *c, km_cuda_buffer *b, size_t bytes)
{
    return km_cuda_host_reserve(c, b, bytes, 0);
}

/* Sub-arrays carved from one buffer start on 256-byte boundaries (cudaMalloc's alignment), so CUB
 * and the copy engines see the alignment they would get from separate allocations. */
static size_t km_cuda_align(size_t bytes)
{
    return (bytes + 255) & ~(size_t)255;
}

static unsigned km_cuda_grid(uint64_t items, unsigned threads)
{
    uint64_t blocks = (items + threads - 1) / threads;
    if (blocks == 0)
        blocks = 1;
    if (blocks > KM_CUDA_MAX_GRID)
        blocks = KM_CUDA_MAX_GRID;
    return (unsigned)blocks;
}

/* ---- kernels and launchers -------------------------------------------------------------------- */

/* The device-usability probe: proves this build's machine code loads and runs on the device. */
static __global__ void km_probe_kernel(uint32_t *out)
{
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *out = 0x6b6d6174u;
}

static cudaError_t km_launch_probe(cudaStream_t stream, uint32_t *out)
{
    km_probe_kernel<<<1, 1, 0, stream>>>(out);
    return cudaGetLastError();
}

/* Patch replica slots: slots[index[i]] = staged[i]. The host staged each destination once
 * (km_cuda_patch_slots), so every slot has one writer. */
static __global__ void km_scatter_slots_kernel(km_slot *slots, const uint64_t *index,
                                               const km_slot *staged, uint32_t n)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        slots[index[i]] = staged[i];
}

static cudaError_t km_launch_scatter_slots(cudaStream_t stream, km_slot *slots,
                                           const uint64_t *index, const km_slot *staged, uint32_t n)
{
    km_scatter_slots_kernel<<<km_cuda_grid(n, KM_CUDA_COPY_THREADS), KM_CUDA_COPY_THREADS, 0,
                              stream>>>(slots, index, staged, n);
    return cudaGetLastError();
}

/* Patch replica bitmaps: one thread per (entry, word); each destination staged once. */
static __global__ void km_scatter_sets_kernel(uint64_t *pool, uint32_t words_per_set,
                                              const uint32_t *index, const uint64_t *staged,
                                              uint32_t n)
{
    uint64_t total = (uint64_t)n * words_per_set;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t i = (uint32_t)(t / words_per_set);
        uint32_t w = (uint32_t)(t % words_per_set);
        pool[(uint64_t)index[i] * words_per_set + w] = staged[t];
    }
}

static cudaError_t km_launch_scatter_sets(cudaStream_t stream, uint64_t *pool,
                                          uint32_t words_per_set, const uint32_t *index,
                                          const uint64_t *staged, uint32_t n)
{
    km_scatter_sets_kernel<<<km_cuda_grid((uint64_t)n * words_per_set, KM_CUDA_COPY_THREADS),
                             KM_CUDA_COPY_THREADS, 0, stream>>>(pool, words_per_set, index, staged,
                                                                n);
    return cudaGetLastError();
}

/* Where a chunk's per-request outputs live (device): four arrays of n u32. */
typedef struct km_cuda_walk_out {
    uint32_t *count;
    uint32_t *owner;
    uint32_t *owner_depth;
    uint32_t *probes;
} km_cuda_walk_out;

/* Scoring: warp w of the grid walks request w with km_warp_walk_request, the code the host warp
 * emulation checks against the CPU backend (tests/test_warp_walk.c), on the replica. Request r's
 * hashes are hashes[offsets[r] .. offsets[r+1]); its entries land in entries[r * max_workers ..)
 * (ascending by worker); its walk scratch is the warp's slice of dynamic shared memory when
 * scratch_shared, else scratch[r * KM_WALK_SCRATCH_WORDS(max_workers) ..). A warp past the last
 * request leaves as a whole, so every collective in the walk has all 32 lanes. */
static __global__ void km_warp_walk_kernel(km_table_view blocks, km_table_view segments,
                                           uint32_t segment_blocks, const uint64_t *hashes,
                                           const uint64_t *offsets, uint32_t n,
                                           uint32_t max_workers, km_walk_entry *entries,
                                           uint64_t *scratch, int scratch_shared,
                                           km_cuda_walk_out out)
{
    extern __shared__ uint64_t km_walk_shared[];
    uint32_t warp = threadIdx.x / KM_WARP_LANES;
    uint64_t r = (uint64_t)blockIdx.x * KM_CUDA_WALK_WARPS + warp;
    if (r >= n)
        return;
    km_lane lane = {threadIdx.x % KM_WARP_LANES, NULL, NULL};
    uint64_t words = KM_WALK_SCRATCH_WORDS((uint64_t)max_workers);
    uint64_t *mine = scratch_shared ? km_walk_shared + warp * words : scratch + r * words;
    uint64_t begin = offsets[r];
    uint32_t len = (uint32_t)(offsets[r + 1] - begin);
    uint32_t owner, owner_depth, probes;
    uint32_t count = km_warp_walk_request(&lane, &blocks, &segments, segment_blocks, hashes + begin,
                                          len, entries + r * max_workers, mine, &owner,
                                          &owner_depth, &probes);
    if (lane.id == 0) {
        out.count[r] = count;
        out.owner[r] = owner;
        out.owner_depth[r] = owner_depth;
        out.probes[r] = probes;
    }
}

static cudaError_t km_launch_walk(cudaStream_t stream, km_table_view blocks,
                                  km_table_view segments, uint32_t segment_blocks,
                                  const uint64_t *hashes, const uint64_t *offsets, uint32_t n,
                                  uint32_t max_workers, km_walk_entry *entries, uint64_t *scratch,
                                  km_cuda_walk_out out)
{
    unsigned grid = (unsigned)((n + KM_CUDA_WALK_WARPS - 1) / KM_CUDA_WALK_WARPS);
    size_t shared = KM_CUDA_WALK_WARPS * KM_WALK_SCRATCH_WORDS((size_t)max_workers) * sizeof(uint64_t);
    int scratch_shared = shared <= KM_CUDA_WALK_SHARED_BYTES;
    km_warp_walk_kernel<<<grid, KM_CUDA_WALK_WARPS * KM_WARP_LANES, scratch_shared ? shared : 0,
                          stream>>>(blocks, segments, segment_blocks, hashes, offsets, n,
                                    max_workers, entries, scratch, scratch_shared, out);
    return cudaGetLastError();
}

/* Compaction: one warp per request copies its count entries from its scratch row to
 * compact[first[r] ..) (first = exclusive prefix sum of the counts). Rows and compact both hold
 * n * max_workers entries; a count past max_workers (a broken walk, which the host reports as
 * KM_ERR_INTERNAL from the counts it reads back) is cut to what the row holds and to what is left
 * of compact, so no count makes this read or write outside them. */
static __global__ void km_gather_kernel(const km_walk_entry *entries, uint32_t max_workers,
                                        const uint32_t *count, const uint32_t *first, uint32_t n,
                                        km_walk_entry *compact)
{
    uint64_t thread = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t r = thread / 32u;
    uint32_t lane = (uint32_t)(thread % 32u);
    if (r >= n)
        return;
    uint64_t room = (uint64_t)n * max_workers;
    uint64_t at = first[r];
    if (at >= room)
        return;
    uint64_t m = count[r] < max_workers ? count[r] : max_workers;
    if (m > room - at)
        m = room - at;
    const km_walk_entry *src = entries + r * max_workers;
    km_walk_entry *dst = compact + at;
    for (uint64_t j = lane; j < m; j += 32u)
        dst[j] = src[j];
}

static cudaError_t km_launch_gather(cudaStream_t stream, const km_walk_entry *entries,
                                    uint32_t max_workers, const uint32_t *count,
                                    const uint32_t *first, uint32_t n, km_walk_entry *compact)
{
    unsigned per_block = KM_CUDA_COPY_THREADS / 32u; /* requests per block */
    unsigned grid = (unsigned)((n + per_block - 1) / per_block);
    km_gather_kernel<<<grid, KM_CUDA_COPY_THREADS, 0, stream>>>(entries, max_workers, count, first,
                                                               n, compact);
    return cudaGetLastError();
}

/* ---- lifecycle -------------------------------------------------------------------------------- */

static void km_cuda_buffer_free_device(km_cuda_buffer *b)
{
    if (b->ptr)
        (void)cudaFree(b->ptr);
    b->ptr = NULL;
    b->bytes = 0;
}

static void km_cuda_replica_free(km_cuda_replica *r)
{
    if (r->slots)
        (void)cudaFree(r->slots);
    if (r->pool)
        (void)cudaFree(r->pool);
    memset(r, 0, sizeof *r);
}

extern "C" void km_cuda_destroy(km_cuda *c)
{
    if (!c)
        return;
    /* Errors are ignored: after a sticky error every call fails, and freeing is all that is left. */
    (void)cudaSetDevice(c->device);
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    for (int i = 0; i < KM_CUDA_TABLE_COUNT; i++)
        km_cuda_replica_free(&c->tables[i]);
    km_cuda_buffer_free_device(&c->sync_dev);
    km_cuda_buffer_free_device(&c->temp_dev);
    km_cuda_buffer_free_device(&c->offsets_dev);
    km_cuda_buffer_free_device(&c->meta_dev);
    km_cuda_buffer_free_device(&c->entries_dev);
    km_cuda_buffer_free_device(&c->scratch_dev);
    km_cuda_buffer_free_device(&c->compact_dev);
    km_cuda_buffer_free_pinned(&c->sync_host[0]);
    km_cuda_buffer_free_pinned(&c->sync_host[1]);
    free(c->staged_bits);
    km_cuda_buffer_free_pinned(&c->offsets_host);
    km_cuda_buffer_free_pinned(&c->hashes_host);
    km_cuda_buffer_free_pinned(&c->meta_host);
    km_cuda_buffer_free_pinned(&c->matches_host);
    for (int i = 0; i < 2; i++)
        if (c->sync_staging_free[i])
            (void)cudaEventDestroy(c->sync_staging_free[i]);
    for (unsigned i = 0; i < KM_CUDA_RESULT_PIECES; i++)
        if (c->results_arrived[i])
            (void)cudaEventDestroy(c->results_arrived[i]);
    if (c->stream)
        (void)cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    free(c);
}

/* Is this launch/probe error "this device cannot run this build" rather than a failure? */
static int km_cuda_error_means_unavailable(cudaError_t e)
{
    return e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction ||
           e == cudaErrorUnsupportedPtxVersion || e == cudaErrorInsufficientDriver ||
           e == cudaErrorNoDevice || e == cudaErrorInvalidDevice ||
           e == cudaErrorDevicesUnavailable || e == cudaErrorSystemDriverMismatch ||
           e == cudaErrorCompatNotSupportedOnDevice || e == cudaErrorInvalidPtx ||
           e == cudaErrorJitCompilerNotFound;
}

/* A failed step of km_cuda_create: KM_ERR_OUT_OF_MEMORY when the device's memory ran out (another
 * process may hold it), else KM_ERR_CUDA; why names the step. */
static int km_cuda_create_failed(int device, const char *step, cudaError_t e, char *why,
                                 size_t why_size)
{
    (void)cudaGetLastError();
    snprintf(why, why_size, "CUDA device %d: %s: %s [%s]", device, step, cudaGetErrorString(e),
             cudaGetErrorName(e));
    return e == cudaErrorMemoryAllocation ? KM_ERR_OUT_OF_MEMORY : KM_ERR_CUDA;
}

/* Run the probe kernel on the current device; KM_OK, or a reason in why. */
static int km_cuda_probe(int device, int major, int minor, char *why, size_t why_size)
{
    uint32_t *d_out = NULL, h_out = 0;
    const char *step = "allocating the probe's word (cudaMalloc)";
    cudaError_t e = cudaMalloc(&d_out, sizeof *d_out);
    if (e == cudaSuccess) {
        step = "launching the probe kernel";
        e = km_launch_probe(0, d_out);
    }
    if (e == cudaSuccess) {
        step = "reading the probe's word back (cudaMemcpy)";
        e = cudaMemcpy(&h_out, d_out, sizeof h_out, cudaMemcpyDeviceToHost);
    }
    if (d_out)
        (void)cudaFree(d_out);
    if (e != cudaSuccess) {
        if (km_cuda_error_means_unavailable(e)) {
            (void)cudaGetLastError();
            snprintf(why, why_size,
                     "CUDA device %d (sm_%d%d) cannot run this build's kernels: %s [%s]", device,
                     major, minor, cudaGetErrorString(e), cudaGetErrorName(e));
            return KM_ERR_BACKEND_UNAVAILABLE;
        }
        return km_cuda_create_failed(device, step, e, why, why_size);
    }
    if (h_out != 0x6b6d6174u) {
        snprintf(why, why_size, "CUDA device %d: probe kernel wrote 0x%08x, expected 0x6b6d6174",
                 device, (unsigned)h_out);
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    return KM_OK;
}

extern "C" int km_cuda_create(int device, km_cuda **out, char *why, size_t why_size)
{
    char dummy[8];
    if (!why || why_size == 0) {
        why = dummy;
        why_size = sizeof dummy;
    }
    why[0] = '\0';
    if (!out) {
        snprintf(why, why_size, "km_cuda_create: out is NULL");
        return KM_ERR_NULL_POINTER;
    }
    *out = NULL;

    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, why_size, "no CUDA device: cudaGetDeviceCount: %s [%s]",
                 cudaGetErrorString(e), cudaGetErrorName(e));
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    if (count <= 0) {
        snprintf(why, why_size, "no CUDA device: cudaGetDeviceCount found none");
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    if (device < 0 || device >= count) {
        snprintf(why, why_size, "no CUDA device %d: %d device%s present (config cuda_device)",
                 device, count, count == 1 ? "" : "s");
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    int major = 0, minor = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, why_size, "CUDA device %d: cudaDeviceGetAttribute: %s [%s]", device,
                 cudaGetErrorString(e), cudaGetErrorName(e));
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    if (major < 7) {
        snprintf(why, why_size, "CUDA device %d is sm_%d%d; kvmatch needs compute capability 7.0+",
                 device, major, minor);
        return KM_ERR_BACKEND_UNAVAILABLE;
    }
    e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, why_size, "CUDA device %d: cudaSetDevice: %s [%s]", device,
                 cudaGetErrorString(e), cudaGetErrorName(e));
        return km_cuda_error_means_unavailable(e) ? KM_ERR_BACKEND_UNAVAILABLE : KM_ERR_CUDA;
    }
    int rc = km_cuda_probe(device, major, minor, why, why_size);
    if (rc != KM_OK)
        return rc;

    km_cuda *c = (km_cuda *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(why, why_size, "CUDA backend: out of host memory");
        return KM_ERR_OUT_OF_MEMORY;
    }
    c->device = device;
    const char *step = "creating the stream";
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        step = "creating the stream's events";
    for (int i = 0; i < 2 && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&c->sync_staging_free[i], cudaEventDisableTiming);
    for (unsigned i = 0; i < KM_CUDA_RESULT_PIECES && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&c->results_arrived[i], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        rc = km_cuda_create_failed(device, step, e, why, why_size);
        km_cuda_destroy(c);
        return rc;
    }

    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        snprintf(c->description, sizeof c->description,
                 "%.120s (device %d, sm_%d%d, %d SMs, %.1f GiB)", prop.name, device, major, minor,
                 prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    } else {
        (void)cudaGetLastError();
        snprintf(c->description, sizeof c->description, "CUDA device %d (sm_%d%d)", device, major,
                 minor);
    }
    snprintf(why, why_size, "%s", c->description); /* for the caller's log line */
    *out = c;
    return KM_OK;
}

extern "C" const char *km_cuda_describe(const km_cuda *c)
{
    return c ? c->description : "";
}

extern "C" const char *km_cuda_last_error(const km_cuda *c)
{
    return c ? c->last_error : "";
}

/* ---- replica sync ----------------------------------------------------------------------------- */

/* Reallocate (when the shape changed) and upload one table whole. The host pointers are pageable
 * memory, so the stream is drained before returning: the host may change the table afterwards. */
static int km_cuda_upload_table(km_cuda *c, km_cuda_replica *r, const km_cuda_table_source *src)
{
    /* Queued scoring may read the old replica; nothing may overwrite or free it before it ends. */
    KM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
    c->sync_staging_pending[0] = c->sync_staging_pending[1] = 0;
    r->valid = 0;
    if (r->capacity != src->capacity) {
        if (r->slots) {
            km_slot *old = r->slots;
            r->slots = NULL;
            r->capacity = 0;
            KM_CUDA_CHECK(c, cudaFree(old));
        }
        if (src->capacity > 0)
            KM_CUDA_CHECK(c, cudaMalloc((void **)&r->slots, src->capacity * sizeof(km_slot)));
        r->capacity = src->capacity;
    }
    size_t pool_words = (size_t)src->pool_capacity * src->words_per_set;
    if (r->pool_capacity != src->pool_capacity || r->words_per_set != src->words_per_set) {
        if (r->pool) {
            uint64_t *old = r->pool;
            r->pool = NULL;
            r->pool_capacity = 0;
            KM_CUDA_CHECK(c, cudaFree(old));
        }
        if (pool_words > 0)
            KM_CUDA_CHECK(c, cudaMalloc((void **)&r->pool, pool_words * sizeof(uint64_t)));
        r->pool_capacity = src->pool_capacity;
    }
    r->words_per_set = src->words_per_set;
    if (src->capacity > 0)
        KM_CUDA_CHECK(c, cudaMemcpyAsync(r->slots, src->slots, src->capacity * sizeof(km_slot),
                                         cudaMemcpyHostToDevice, c->stream));
    if (pool_words > 0) {
        /* Bitmaps never handed out are never referenced; zero them so the replica is fully defined. */
        size_t used_words = (size_t)src->pool_used * src->words_per_set;
        if (used_words > 0)
            KM_CUDA_CHECK(c, cudaMemcpyAsync(r->pool, src->pool, used_words * sizeof(uint64_t),
                                             cudaMemcpyHostToDevice, c->stream));
        if (used_words < pool_words)
            KM_CUDA_CHECK(c, cudaMemsetAsync(r->pool + used_words, 0,
                                             (pool_words - used_words) * sizeof(uint64_t),
                                             c->stream));
    }
    KM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
    r->valid = 1;
    return KM_OK;
}

/* The pinned staging buffer the next round fills, once the copies that read it have completed. */
static int km_cuda_next_sync_staging(km_cuda *c, int *which)
{
    int b = c->sync_staging_next;
    c->sync_staging_next ^= 1;
    if (c->sync_staging_pending[b]) {
        KM_CUDA_CHECK(c, cudaEventSynchronize(c->sync_staging_free[b]));
        c->sync_staging_pending[b] = 0;
    }
    *which = b;
    return KM_OK;
}

/* Both pinned staging buffers and the device one hold `bytes`. */
static int km_cuda_sync_staging_reserve(km_cuda *c, size_t bytes)
{
    KM_CHECK(km_cuda_pinned_reserve(c, &c->sync_host[0], bytes));
    KM_CHECK(km_cuda_pinned_reserve(c, &c->sync_host[1], bytes));
    return km_cuda_device_reserve(c, &c->sync_dev, bytes);
}

/* The staged-destination bitmap covers `bits` destinations (all zero). */
static int km_cuda_staged_bits_reserve(km_cuda *c, uint64_t bits)
{
    if (bits <= c->staged_bits_capacity)
        return KM_OK;
    uint64_t words = (bits + 63) / 64;
    uint64_t *fresh = (uint64_t *)calloc(words, sizeof(uint64_t));
    if (!fresh)
        return km_cuda_fail_status(c, KM_ERR_OUT_OF_MEMORY,
                                   "CUDA backend: %llu bytes for the staged-destination bitmap",
                                   (unsigned long long)(words * sizeof(uint64_t)));
    free(c->staged_bits);
    c->staged_bits = fresh;
    c->staged_bits_capacity = words * 64;
    return KM_OK;
}

/* Mark destination i staged; nonzero when it already was. */
static int km_cuda_staged_before(km_cuda *c, uint64_t i)
{
    uint64_t bit = UINT64_C(1) << (i & 63);
    uint64_t *word = &c->staged_bits[i >> 6];
    int before = (*word & bit) != 0;
    *word |= bit;
    return before;
}

/* Stage dirty[0..n) of a slot list, each destination once, in rounds of at most K; copy and
 * scatter each round. Staging layout: [km_slot payload[K]][u64 index[K]], 256-byte aligned. */
static int km_cuda_patch_slot_rounds(km_cuda *c, km_cuda_replica *r, const km_cuda_table_source *src,
                                     size_t K, size_t index_at)
{
    const size_t n = src->n_dirty_slots;
    for (size_t next = 0; next < n;) {
        int b;
        KM_CHECK(km_cuda_next_sync_staging(c, &b));
        char *h_base = (char *)c->sync_host[b].ptr, *d_base = (char *)c->sync_dev.ptr;
        km_slot *h_payload = (km_slot *)h_base;
        uint64_t *h_index = (uint64_t *)(h_base + index_at);
        uint32_t k = 0;
        while (next < n && k < K) {
            uint64_t slot = src->dirty_slots[next++];
            if (km_cuda_staged_before(c, slot))
                continue;
            h_index[k] = slot;
            h_payload[k] = src->slots[slot];
            k++;
        }
        if (k == 0)
            break;
        KM_CUDA_CHECK(c, cudaMemcpyAsync(d_base, h_payload, (size_t)k * sizeof(km_slot),
                                         cudaMemcpyHostToDevice, c->stream));
        KM_CUDA_CHECK(c, cudaMemcpyAsync(d_base + index_at, h_index, (size_t)k * sizeof(uint64_t),
                                         cudaMemcpyHostToDevice, c->stream));
        KM_CUDA_CHECK(c, cudaEventRecord(c->sync_staging_free[b], c->stream));
        c->sync_staging_pending[b] = 1;
        KM_CUDA_CHECK(c, km_launch_scatter_slots(c->stream, r->slots,
                                                 (const uint64_t *)(d_base + index_at),
                                                 (const km_slot *)d_base, k));
    }
    return KM_OK;
}

/* Patch the dirty slots: each listed slot once (the list repeats some), in rounds bounded by the
 * staging size. */
static int km_cuda_patch_slots(km_cuda *c, km_cuda_replica *r, const km_cuda_table_source *src)
{
    size_t n = src->n_dirty_slots;
    if (n == 0)
        return KM_OK;
    size_t K = KM_CUDA_SYNC_ROUND_BYTES / (sizeof(km_slot) + sizeof(uint64_t));
    if (K > n)
        K = n;
    size_t index_at = km_cuda_align(K * sizeof(km_slot));
    KM_CHECK(km_cuda_sync_staging_reserve(c, index_at + K * sizeof(uint64_t)));
    KM_CHECK(km_cuda_staged_bits_reserve(c, src->capacity));
    int rc = km_cuda_patch_slot_rounds(c, r, src, K, index_at);
    for (size_t i = 0; i < n; i++) /* all zero again, whatever the rounds got through */
        c->staged_bits[src->dirty_slots[i] >> 6] = 0;
    return rc;
}

/* The same for bitmaps. Staging: [u64 payload[K * words_per_set]][u32 index[K]]. */
static int km_cuda_patch_set_rounds(km_cuda *c, km_cuda_replica *r, const km_cuda_table_source *src,
                                    size_t K, size_t index_at)
{
    const size_t n = src->n_dirty_sets;
    const uint32_t wps = src->words_per_set;
    for (size_t next = 0; next < n;) {
        int b;
        KM_CHECK(km_cuda_next_sync_staging(c, &b));
        char *h_base = (char *)c->sync_host[b].ptr, *d_base = (char *)c->sync_dev.ptr;
        uint64_t *h_payload = (uint64_t *)h_base;
        uint32_t *h_index = (uint32_t *)(h_base + index_at);
        uint32_t k = 0;
        while (next < n && k < K) {
            uint32_t set = src->dirty_sets[next++];
            if (km_cuda_staged_before(c, set))
                continue;
            h_index[k] = set;
            memcpy(h_payload + (size_t)k * wps, src->pool + (size_t)set * wps,
                   (size_t)wps * sizeof(uint64_t));
            k++;
        }
        if (k == 0)
            break;
        KM_CUDA_CHECK(c, cudaMemcpyAsync(d_base, h_payload, (size_t)k * wps * sizeof(uint64_t),
                                         cudaMemcpyHostToDevice, c->stream));
        KM_CUDA_CHECK(c, cudaMemcpyAsync(d_base + index_at, h_index, (size_t)k * sizeof(uint32_t),
                                         cudaMemcpyHostToDevice, c->stream));
        KM_CUDA_CHECK(c, cudaEventRecord(c->sync_staging_free[b], c->stream));
        c->sync_staging_pending[b] = 1;
        KM_CUDA_CHECK(c, km_launch_scatter_sets(c->stream, r->pool, wps,
                                                (const uint32_t *)(d_base + index_at),
                                                (const uint64_t *)d_base, k));
    }
    return KM_OK;
}

static int km_cuda_patch_sets(km_cuda *c, km_cuda_replica *r, const km_cuda_table_source *src)
{
    size_t n = src->n_dirty_sets;
    if (n == 0)
        return KM_OK;
    uint32_t wps = src->words_per_set;
    size_t K = KM_CUDA_SYNC_ROUND_BYTES / ((size_t)wps * sizeof(uint64_t) + sizeof(uint32_t));
    if (K == 0)
        K = 1;
    if (K > n)
        K = n;
    size_t index_at = km_cuda_align(K * wps * sizeof(uint64_t));
    KM_CHECK(km_cuda_sync_staging_reserve(c, index_at + K * sizeof(uint32_t)));
    KM_CHECK(km_cuda_staged_bits_reserve(c, src->pool_capacity));
    int rc = km_cuda_patch_set_rounds(c, r, src, K, index_at);
    for (size_t i = 0; i < n; i++)
        c->staged_bits[src->dirty_sets[i] >> 6] = 0;
    return rc;
}

static int km_cuda_source_valid(km_cuda *c, const km_cuda_table_source *src)
{
    if (!src)
        return km_cuda_fail_status(c, KM_ERR_NULL_POINTER, "CUDA backend: table source is NULL");
    if (src->capacity > 0) {
        if (!src->slots)
            return km_cuda_fail_status(c, KM_ERR_INVALID_ARGUMENT,
                                       "CUDA backend: bad table shape (capacity %llu, no slots)",
                                       (unsigned long long)src->capacity);
    }
    if (src->words_per_set == 0 || src->pool_used > src->pool_capacity ||
        (src->pool_used > 0 && !src->pool))
        return km_cuda_fail_status(c, KM_ERR_INVALID_ARGUMENT,
                                   "CUDA backend: bad bitmap pool (%u of %u used, %u words each)",
                                   (unsigned)src->pool_used, (unsigned)src->pool_capacity,
                                   (unsigned)src->words_per_set);
    if ((src->n_dirty_slots > 0 && !src->dirty_slots) || (src->n_dirty_sets > 0 && !src->dirty_sets))
        return km_cuda_fail_status(c, KM_ERR_NULL_POINTER, "CUDA backend: dirty list is NULL");
    return KM_OK;
}

extern "C" int km_cuda_sync_table(km_cuda *c, km_cuda_table_id id, const km_cuda_table_source *src)
{
    if (!c)
        return KM_ERR_NULL_POINTER;
    c->last_error[0] = '\0';
    if ((int)id < 0 || (int)id >= KM_CUDA_TABLE_COUNT)
        return km_cuda_fail_status(c, KM_ERR_INVALID_ARGUMENT, "CUDA backend: no table %d", (int)id);
    KM_CHECK(km_cuda_source_valid(c, src));
    KM_CUDA_CHECK(c, cudaSetDevice(c->device));
    (void)cudaGetLastError(); /* another caller's unread error is not this call's (km_launch_*) */
    km_cuda_replica *r = &c->tables[id];

    int full = src->full || !r->valid || r->capacity != src->capacity ||
               r->words_per_set != src->words_per_set || r->pool_capacity != src->pool_capacity;
    /* A dirty list as long as the table (repeats count) costs more to patch than the table costs
     * to upload whole. */
    if (!full && (src->n_dirty_slots >= src->capacity || src->n_dirty_sets > src->pool_capacity))
        full = 1;
    /* An index outside the table breaks the dirty-list contract; the whole table is still right. */
    for (size_t i = 0; !full && i < src->n_dirty_slots; i++)
        full = src->dirty_slots[i] >= src->capacity;
    for (size_t i = 0; !full && i < src->n_dirty_sets; i++)
        full = src->dirty_sets[i] >= src->pool_capacity;
    if (full)
        return km_cuda_upload_table(c, r, src);

    /* A failed patch leaves the replica partly patched: mark it stale so that a retry uploads it
     * whole (the index falls back to the CPU backend on KM_ERR_CUDA anyway). */
    r->valid = 0;
    KM_CHECK(km_cuda_patch_slots(c, r, src));
    KM_CHECK(km_cuda_patch_sets(c, r, src));
    r->valid = 1;
    return KM_OK;
}

/* ---- host copies on the caller's threads --------------------------------------------------- */

static void km_cuda_host_for_each(const km_cuda_match_args *args, size_t n_parts,
                                  void (*part)(void *arg, size_t i), void *arg)
{
    if (args->for_each) {
        args->for_each(args->for_each_ctx, n_parts, part, arg);
        return;
    }
    for (size_t i = 0; i < n_parts; i++)
        part(arg, i);
}

/* Packing requests [0, end) of a chunk: request i's hashes go to hashes + offsets[i]. */
typedef struct km_cuda_pack_job {
    const km_request *requests;
    const uint64_t *offsets;
    uint64_t *hashes;
    uint32_t end;
} km_cuda_pack_job;

static void km_cuda_pack_part(void *arg, size_t part)
{
    const km_cuda_pack_job *job = (const km_cuda_pack_job *)arg;
    uint64_t from = (uint64_t)part * KM_CUDA_STAGE_PART_REQUESTS;
    uint64_t to = from + KM_CUDA_STAGE_PART_REQUESTS < job->end ? from + KM_CUDA_STAGE_PART_REQUESTS
                                                                : job->end;
    for (uint64_t i = from; i < to; i++)
        if (job->requests[i].n_hashes > 0)
            memcpy(job->hashes + job->offsets[i], job->requests[i].hashes,
                   (size_t)job->requests[i].n_hashes * sizeof(uint64_t));
}

/* A plain copy of `bytes`, KM_CUDA_RESULT_PART_BYTES per part. */
typedef struct km_cuda_copy_job {
    char *to;
    const char *from;
    size_t bytes;
} km_cuda_copy_job;

static void km_cuda_copy_part(void *arg, size_t part)
{
    const km_cuda_copy_job *job = (const km_cuda_copy_job *)arg;
    size_t at = part * KM_CUDA_RESULT_PART_BYTES;
    size_t len = job->bytes - at < KM_CUDA_RESULT_PART_BYTES ? job->bytes - at
                                                             : KM_CUDA_RESULT_PART_BYTES;
    memcpy(job->to + at, job->from + at, len);
}

/* Bring `count` compacted entries back into `to` (the caller's results): device to pinned in
 * pieces, each moved on by the host threads while the next is on the bus. Returns with the stream
 * idle on success. */
static int km_cuda_copy_back(km_cuda *c, const km_cuda_match_args *args, km_walk_entry *to,
                             size_t count)
{
    size_t bytes = count * sizeof(km_walk_entry);
    if (bytes == 0)
        return KM_OK;
    KM_CHECK(km_cuda_pinned_reserve(c, &c->matches_host, bytes));
    size_t pieces = bytes / KM_CUDA_RESULT_PIECE_MIN;
    if (pieces < 1)
        pieces = 1;
    if (pieces > KM_CUDA_RESULT_PIECES)
        pieces = KM_CUDA_RESULT_PIECES;
    size_t piece_entries = (count + pieces - 1) / pieces;
    pieces = (count + piece_entries - 1) / piece_entries; /* none empty */
    size_t per_piece = piece_entries * sizeof(km_walk_entry);
    char *landing = (char *)c->matches_host.ptr;
    const char *from = (const char *)c->compact_dev.ptr;
    /* Every piece has its own landing place and its own event, so all are queued at once. */
    for (size_t k = 0; k < pieces; k++) {
        size_t at = k * per_piece;
        size_t len = bytes - at < per_piece ? bytes - at : per_piece;
        KM_CUDA_CHECK(c, cudaMemcpyAsync(landing + at, from + at, len, cudaMemcpyDeviceToHost,
                                         c->stream));
        KM_CUDA_CHECK(c, cudaEventRecord(c->results_arrived[k], c->stream));
    }
    for (size_t k = 0; k < pieces; k++) {
        KM_CUDA_CHECK(c, cudaEventSynchronize(c->results_arrived[k]));
        size_t at = k * per_piece;
        km_cuda_copy_job job = {(char *)to + at, landing + at,
                                bytes - at < per_piece ? bytes - at : per_piece};
        km_cuda_host_for_each(args, (job.bytes + KM_CUDA_RESULT_PART_BYTES - 1) /
                                        KM_CUDA_RESULT_PART_BYTES,
                              km_cuda_copy_part, &job);
    }
    return KM_OK;
}

/* ---- scoring ---------------------------------------------------------------------------------- */

static km_table_view km_cuda_view_of(const km_cuda_replica *r)
{
    km_table_view v;
    v.slots = r->slots;
    v.pool = r->pool;
    v.capacity = r->capacity;
    v.words_per_set = r->words_per_set;
    v.old_slots = NULL; /* the host finishes a growth before it syncs the replica */
    v.old_capacity = 0;
    v.migrated = 0;
    return v;
}

/* Score requests[0..m) (one chunk) into results->requests[first_request ..) and
 * results->matches[results->n_matches ..), growing results->matches with args->reserve (which keeps
 * the contents: km_match_results_reserve reallocates); adds to n_matches and probes. */
static int km_cuda_match_chunk(km_cuda *c, const km_cuda_match_args *args,
                               const km_request *requests, uint32_t m, uint64_t n_hashes,
                               size_t first_request, size_t n_requests, km_match_results *results)
{
    uint32_t W = args->max_workers;
    /* Stage the hashes, packed, with offsets. The walk reads the packed hashes where they lie
     * (mapped pinned memory). Every return after the first copy below is queued either
     * synchronises the stream or ends the backend (km_cuda_destroy synchronises), so no copy or
     * kernel still reads the pinned buffers here. */
    KM_CHECK(km_cuda_pinned_reserve(c, &c->offsets_host, ((size_t)m + 1) * sizeof(uint64_t)));
    KM_CHECK(km_cuda_device_reserve(c, &c->offsets_dev, ((size_t)m + 1) * sizeof(uint64_t)));
    if (n_hashes > 0)
        KM_CHECK(km_cuda_host_reserve(c, &c->hashes_host, n_hashes * sizeof(uint64_t), 1));
    uint64_t *h_offsets = (uint64_t *)c->offsets_host.ptr;
    uint64_t at = 0;
    for (uint32_t i = 0; i < m; i++) {
        h_offsets[i] = at;
        at += requests[i].n_hashes;
    }
    h_offsets[m] = at;
    KM_CUDA_CHECK(c, cudaMemcpyAsync(c->offsets_dev.ptr, h_offsets, ((size_t)m + 1) * sizeof(uint64_t),
                                     cudaMemcpyHostToDevice, c->stream));
    if (n_hashes > 0) {
        km_cuda_pack_job job = {requests, h_offsets, (uint64_t *)c->hashes_host.ptr, m};
        km_cuda_host_for_each(args, (m + KM_CUDA_STAGE_PART_REQUESTS - 1) /
                                        KM_CUDA_STAGE_PART_REQUESTS,
                              km_cuda_pack_part, &job);
    }

    /* Walk: per-request outputs are 4 packed arrays of m u32 (one copy back), then, 256-byte
     * aligned, first[m] from the scan. Scratch rows and meta_dev are reserved by the caller for
     * the largest chunk. */
    uint32_t *d_meta = (uint32_t *)c->meta_dev.ptr;
    km_cuda_walk_out out;
    out.count = d_meta;
    out.owner = d_meta + m;
    out.owner_depth = d_meta + 2 * (size_t)m;
    out.probes = d_meta + 3 * (size_t)m;
    uint32_t *d_first = (uint32_t *)((char *)c->meta_dev.ptr +
                                     km_cuda_align(4 * (size_t)m * sizeof(uint32_t)));
    const uint64_t *d_hashes = n_hashes > 0 ? (const uint64_t *)c->hashes_host.device_view
                                            : (const uint64_t *)c->offsets_dev.ptr; /* never read */
    KM_CUDA_CHECK(c, km_launch_walk(c->stream, km_cuda_view_of(&c->tables[KM_CUDA_TABLE_BLOCKS]),
                                    km_cuda_view_of(&c->tables[KM_CUDA_TABLE_SEGMENTS]),
                                    args->segment_blocks, d_hashes,
                                    (const uint64_t *)c->offsets_dev.ptr, m, W,
                                    (km_walk_entry *)c->entries_dev.ptr,
                                    (uint64_t *)c->scratch_dev.ptr, out));
    size_t temp_bytes = 0;
    KM_CUDA_CHECK(c, cub::DeviceScan::ExclusiveSum(NULL, temp_bytes, out.count, d_first, (int)m,
                                                   c->stream));
    KM_CHECK(km_cuda_temp_reserve(c, temp_bytes));
    KM_CUDA_CHECK(c, cub::DeviceScan::ExclusiveSum(c->temp_dev.ptr, temp_bytes, out.count, d_first,
                                                   (int)m, c->stream));
    /* Compact every request's entries (the caller reserved compact_dev for m * W), and bring the
     * per-request outputs back first: they say how many entries to copy. */
    KM_CUDA_CHECK(c, km_launch_gather(c->stream, (const km_walk_entry *)c->entries_dev.ptr, W,
                                      out.count, d_first, m, (km_walk_entry *)c->compact_dev.ptr));
    uint32_t *h_meta = (uint32_t *)c->meta_host.ptr;
    KM_CUDA_CHECK(c, cudaMemcpyAsync(h_meta, d_meta, 4 * (size_t)m * sizeof(uint32_t),
                                     cudaMemcpyDeviceToHost, c->stream));
    KM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));

    /* The host sums the same counts the scan summed, so its offsets equal d_first. A count past
     * max_workers breaks the walk's contract: the gather kernel kept inside its buffers, and the
     * index moves to the CPU backend on this status. */
    size_t base = results->n_matches;
    size_t chunk_matches = 0;
    uint64_t chunk_probes = 0;
    for (uint32_t i = 0; i < m; i++) {
        uint32_t count = h_meta[i];
        if (count > W)
            return km_cuda_fail_status(c, KM_ERR_INTERNAL,
                                       "CUDA backend: request reported %u matches (max_workers %u)",
                                       (unsigned)count, (unsigned)W);
        km_request_result *res = &results->requests[first_request + i];
        res->first = (uint64_t)(base + chunk_matches);
        res->count = count;
        res->owner = h_meta[m + i];
        res->owner_depth = h_meta[2 * (size_t)m + i];
        res->probes = h_meta[3 * (size_t)m + i];
        chunk_probes += res->probes;
        chunk_matches += count;
    }
    int rc = args->reserve(results, n_requests, base + chunk_matches);
    if (rc != KM_OK)
        return km_cuda_fail_status(c, rc, "CUDA backend: reserving results for %zu matches",
                                   base + chunk_matches);
    KM_CHECK(km_cuda_copy_back(c, args, (km_walk_entry *)results->matches + base, chunk_matches));
    results->probes += chunk_probes;
    results->n_matches = base + chunk_matches;
    return KM_OK;
}

extern "C" int km_cuda_match(km_cuda *c, const km_cuda_match_args *args,
                             const km_request *requests, size_t n, km_match_results *results)
{
    if (!c)
        return KM_ERR_NULL_POINTER;
    c->last_error[0] = '\0';
    if (!args || !args->reserve || !results || (n > 0 && !requests))
        return km_cuda_fail_status(c, KM_ERR_NULL_POINTER, "CUDA backend: NULL argument to match");
    uint32_t W = args->max_workers;
    if (W == 0)
        return km_cuda_fail_status(c, KM_ERR_INVALID_ARGUMENT, "CUDA backend: max_workers is 0");
    for (size_t i = 0; i < n; i++)
        if (requests[i].n_hashes > 0 && !requests[i].hashes)
            return km_cuda_fail_status(c, KM_ERR_NULL_POINTER,
                                       "CUDA backend: request %zu has %u hashes and no array", i,
                                       (unsigned)requests[i].n_hashes);
    int rc = args->reserve(results, n, 0);
    if (rc != KM_OK)
        return km_cuda_fail_status(c, rc, "CUDA backend: reserving results for %zu requests", n);
    results->n_requests = n;
    results->n_matches = 0;
    results->probes = 0;
    if (n == 0)
        return KM_OK;
    const km_cuda_replica *blocks = &c->tables[KM_CUDA_TABLE_BLOCKS];
    const km_cuda_replica *segments = &c->tables[KM_CUDA_TABLE_SEGMENTS];
    if (!blocks->valid || blocks->capacity == 0 ||
        (args->segment_blocks > 0 && (!segments->valid || segments->capacity == 0)))
        return km_cuda_fail_status(c, KM_ERR_INTERNAL,
                                   "CUDA backend: scoring before the table replicas were uploaded");
    /* The walk's bitmaps have the replica's words_per_set words, its scratch rows are sized from
     * W: more words than W needs would run each walk into the next request's row. */
    uint32_t words = (W + 63u) / 64u;
    if (blocks->words_per_set != words ||
        (args->segment_blocks > 0 && segments->words_per_set != words))
        return km_cuda_fail_status(c, KM_ERR_INTERNAL,
                                   "CUDA backend: bitmaps of %u words, %u workers need %u",
                                   (unsigned)blocks->words_per_set, (unsigned)W, (unsigned)words);
    KM_CUDA_CHECK(c, cudaSetDevice(c->device));
    (void)cudaGetLastError(); /* another caller's unread error is not this call's (km_launch_*) */

    /* Chunk capacity from the scratch budget: W walk entries, W compacted entries and the walk's
     * scratch words per request. */
    size_t scratch_words = KM_WALK_SCRATCH_WORDS((size_t)W);
    size_t per_request = 2 * (size_t)W * sizeof(km_walk_entry) + scratch_words * sizeof(uint64_t);
    size_t chunk_cap = KM_CUDA_SCRATCH_BUDGET / per_request;
    if (chunk_cap < 1)
        chunk_cap = 1;
    if (chunk_cap > KM_CUDA_MATCH_CHUNK)
        chunk_cap = KM_CUDA_MATCH_CHUNK;
    if (chunk_cap > n)
        chunk_cap = n;
    KM_CHECK(km_cuda_device_reserve(c, &c->entries_dev, chunk_cap * W * sizeof(km_walk_entry)));
    KM_CHECK(km_cuda_device_reserve(c, &c->compact_dev, chunk_cap * W * sizeof(km_walk_entry)));
    if (KM_CUDA_WALK_WARPS * scratch_words * sizeof(uint64_t) > KM_CUDA_WALK_SHARED_BYTES)
        KM_CHECK(km_cuda_device_reserve(c, &c->scratch_dev,
                                        chunk_cap * scratch_words * sizeof(uint64_t)));
    KM_CHECK(km_cuda_device_reserve(c, &c->meta_dev, km_cuda_align(chunk_cap * 4 * sizeof(uint32_t)) +
                                                         chunk_cap * sizeof(uint32_t)));
    KM_CHECK(km_cuda_pinned_reserve(c, &c->meta_host, chunk_cap * 4 * sizeof(uint32_t)));

    for (size_t start = 0; start < n;) {
        size_t end = start;
        uint64_t hashes = 0;
        while (end < n && end - start < chunk_cap) {
            uint64_t len = requests[end].n_hashes;
            if (end > start && hashes + len > KM_CUDA_HASH_BUDGET)
                break;
            hashes += len;
            end++;
        }
        KM_CHECK(km_cuda_match_chunk(c, args, requests + start, (uint32_t)(end - start), hashes,
                                     start, n, results));
        start = end;
    }
    return KM_OK;
}
