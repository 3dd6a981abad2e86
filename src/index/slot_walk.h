/* SPDX-License-Identifier: Apache-2.0 */
/* Per-element logic shared by the CPU backend and the CUDA kernels: the table slot layout, slot
 * probing, worker-set membership and enumeration, and the per-request prefix walk. Everything here
 * is `static inline` and marked KM_HD, so the CPU backend runs the very code the GPU runs and the
 * two backends give bit-identical results. No allocation, no libc beyond what nvcc accepts.
 *
 * Slot layout (16 bytes, docs/ARCHITECTURE.md "Slot layout"):
 *   key      u64  chain hash; 0 = empty (the whole slot is zero), 1 = reserved: a key erased from
 *                 the old array of a growing host table (chain hashes never take these values)
 *   ids[4]   u16  inline form: up to 4 worker ids, ascending, unused = KM_SLOT_ID_EMPTY
 *                 shared form: ids[0] = KM_SLOT_ID_SHARED, ids[1] | ids[2] << 16 = index of a
 *                 bitmap of words_per_set u64 words in the table's pool, ids[3] = holder count
 * A slot is read in one 16-byte access: one 32-byte sector, one memory transaction. */
#ifndef KM_SHARED_H
#define KM_SHARED_H

#include <stdint.h>
#if !defined(__CUDACC__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__CUDACC__)
/* Not __forceinline__: it expands to __inline__, a duplicate of the `static inline` every use
 * already spells (nvcc: "duplicate specifier in declaration"). nvcc inlines these anyway. */
#define KM_HD __host__ __device__
#define KM_PREFETCH(addr) ((void)0)
#define KM_PREFETCHER KM_HD
#else
#define KM_HD
#define KM_PREFETCH(addr) __builtin_prefetch((addr), 0, 1)
/* For a function whose only effects are prefetches. GCC 12 finds such a function "const" and
 * deletes every call to it it has not inlined yet, so the prefetches silently vanish (found with
 * objdump: km_prefetch_segment_input had no instruction left anywhere). Forcing the inline keeps
 * them; tests/check_prefetch.py checks them in the objects. */
#define KM_PREFETCHER __attribute__((always_inline))
#endif

#define KM_KEY_EMPTY UINT64_C(0)
#define KM_KEY_TOMBSTONE UINT64_C(1)
#define KM_SLOT_INLINE 4u
#define KM_SLOT_ID_EMPTY 0xFFFFu
#define KM_SLOT_ID_SHARED 0xFFFEu
#define KM_SLOT_NONE UINT64_MAX
/* How far ahead the host walk prefetches (keys); a no-op on the device. */
#define KM_PREFETCH_AHEAD 8u

typedef struct __attribute__((aligned(16))) km_slot {
    uint64_t key;
    uint16_t ids[KM_SLOT_INLINE];
} km_slot;

/* A read-only view of one table, valid on the side (host or device) whose pointers it holds. */
typedef struct km_table_view {
    const km_slot *slots;
    const uint64_t *pool;   /* bitmaps of the shared form, words_per_set words each */
    uint64_t capacity;      /* slots; any size >= 1 (km_slot_home maps onto it) */
    uint32_t words_per_set; /* ceil(max_workers / 64) */
    /* A host table that is growing (src/index/host_table.h): its previous array, whose slots below `migrated`
     * have moved. NULL on the device (a replica mirrors one array) and when not growing. A slot
     * index at or above capacity names old_slots[index - capacity]. */
    const km_slot *old_slots;
    uint64_t old_capacity;
    uint64_t migrated;
} km_table_view;

/* An entry of a request's sparse result, as in include/kvmatch/index.h (same layout). */
typedef struct km_walk_entry {
    uint32_t worker;
    uint32_t depth;
} km_walk_entry;

/* Home slot of a key in a table of `capacity` slots: Fibonacci hashing of the full 64 bits (so
 * structured test keys spread too), mapped onto [0, capacity) by multiply-shift range reduction,
 * so a capacity need not be a power of two. For capacity 2^b this is the top b bits of the
 * product. */
KM_HD static inline uint64_t km_slot_home(uint64_t key, uint64_t capacity)
{
    uint64_t h = key * UINT64_C(0x9E3779B97F4A7C15);
#if defined(__CUDA_ARCH__)
    return __umul64hi(h, capacity);
#else
    return (uint64_t)(((unsigned __int128)h * capacity) >> 64);
#endif
}

/* The slot after i in a table of `capacity` slots (probe runs wrap around). */
KM_HD static inline uint64_t km_slot_next(uint64_t i, uint64_t capacity)
{
    return i + 1 == capacity ? 0 : i + 1;
}

KM_HD static inline int km_slot_is_shared(const km_slot *s)
{
    return s->ids[0] == KM_SLOT_ID_SHARED;
}

KM_HD static inline uint32_t km_slot_pool_index(const km_slot *s)
{
    return (uint32_t)s->ids[1] | ((uint32_t)s->ids[2] << 16);
}

KM_HD static inline uint32_t km_slot_count(const km_slot *s)
{
    if (km_slot_is_shared(s))
        return s->ids[3];
    uint32_t n = 0;
    for (uint32_t i = 0; i < KM_SLOT_INLINE; i++)
        n += s->ids[i] != KM_SLOT_ID_EMPTY;
    return n;
}

/* A key not in a growing table's new array: its old array. Slots below `migrated` have moved (and
 * may be unmapped), so the search never reads them: a probe run that starts below `migrated` is
 * entered there, and one that wraps past the last slot continues at `migrated` (the run is whole:
 * the moved slots it crossed are still counted as occupied, and a key below `migrated` is in the
 * new array). Erased keys there are tombstones, so the runs stay whole. The search stops at an
 * empty slot, or when it is back where it started. Host only in practice (old_slots is NULL on the
 * device). */
KM_HD static inline uint64_t km_view_find_old(const km_table_view *v, uint64_t key)
{
    if (key <= KM_KEY_TOMBSTONE) /* reserved: never a key (1 marks an erased one here) */
        return KM_SLOT_NONE;
    uint64_t i = km_slot_home(key, v->old_capacity);
    if (i < v->migrated)
        i = v->migrated;
    uint64_t start = i;
    for (;;) {
        uint64_t k = v->old_slots[i].key;
        if (k == key)
            return v->capacity + i;
        if (k == KM_KEY_EMPTY)
            return KM_SLOT_NONE;
        if (++i == v->old_capacity)
            i = v->migrated;
        if (i == start)
            return KM_SLOT_NONE;
    }
}

/* Linear probing from the home slot (then the old array of a growing table). Returns the slot
 * index, or KM_SLOT_NONE. Contract: the table always has at least one empty slot (load factor
 * < 1), so the loop ends. */
KM_HD static inline uint64_t km_view_find(const km_table_view *v, uint64_t key)
{
    uint64_t i = km_slot_home(key, v->capacity);
    for (;;) {
        uint64_t k = v->slots[i].key;
        if (k == KM_KEY_EMPTY) /* first: a request's reserved value 0 never matches a free slot */
            return v->old_slots ? km_view_find_old(v, key) : KM_SLOT_NONE;
        if (k == key)
            return i;
        i = km_slot_next(i, v->capacity);
    }
}

/* The slot at an index km_view_find returned (either array). */
KM_HD static inline const km_slot *km_view_slot(const km_table_view *v, uint64_t slot)
{
    return slot < v->capacity ? &v->slots[slot] : &v->old_slots[slot - v->capacity];
}

/* Bring a key's home slot and the three after it into cache ahead of its lookup. At load a, linear
 * probing reads (1 + 1 / (1 - a)) / 2 slots on average for a key it finds and
 * (1 + 1 / (1 - a)^2) / 2 for one it does not (the walk's last lookups, where workers drop out,
 * find nothing), and from three home slots in four the fourth slot lies in the next 64-byte line. */
KM_PREFETCHER static inline void km_view_prefetch(const km_table_view *v, uint64_t key)
{
    uint64_t home = km_slot_home(key, v->capacity);
    KM_PREFETCH(&v->slots[home]);
    KM_PREFETCH(&v->slots[home + 3 < v->capacity ? home + 3 : v->capacity - 1]);
    (void)v;
    (void)key;
    (void)home;
}

/* Bring the lines of a request's own hash array that segment k's lookups read (its first block,
 * where a walk inside it starts, and its last, the segment key) into cache ahead of use: the walk
 * reads one hash per segment, a fresh line each time, so the input misses as often as the table
 * does. A no-op on the device. */
KM_PREFETCHER static inline void km_prefetch_segment_input(const uint64_t *hashes, uint32_t S,
                                                           uint32_t k, uint32_t n)
{
    KM_PREFETCH(&hashes[k * S]);
    if ((k + 1) * S <= n)
        KM_PREFETCH(&hashes[(k + 1) * S - 1]);
    (void)hashes;
    (void)S;
    (void)k;
    (void)n;
}

KM_HD static inline int km_slot_contains(const km_slot *s, const uint64_t *pool,
                                         uint32_t words_per_set, uint32_t worker)
{
    if (km_slot_is_shared(s)) {
        const uint64_t *bits = pool + (uint64_t)km_slot_pool_index(s) * words_per_set;
        return (int)((bits[worker >> 6] >> (worker & 63)) & 1u);
    }
    for (uint32_t i = 0; i < KM_SLOT_INLINE; i++)
        if (s->ids[i] == worker)
            return 1;
    return 0;
}

/* Scratch a walk needs, in u64 words: three worker bitmaps and a u32 depth per worker. */
#define KM_WALK_SCRATCH_WORDS(max_workers) \
    (3u * (((max_workers) + 63u) / 64u) + ((max_workers) + 1u) / 2u)

/* out = in ∩ (workers of the slot; empty when slot is KM_SLOT_NONE), word by word. Returns
 * nonzero when out is not empty. */
KM_HD static inline uint64_t km_view_intersect(const km_table_view *v, uint64_t slot,
                                               const uint64_t *in, uint64_t *out)
{
    uint32_t W = v->words_per_set;
    uint64_t any = 0;
    if (slot != KM_SLOT_NONE && km_slot_is_shared(km_view_slot(v, slot))) {
        const uint64_t *bits = v->pool + (uint64_t)km_slot_pool_index(km_view_slot(v, slot)) * W;
        for (uint32_t i = 0; i < W; i++) {
            out[i] = in[i] & bits[i];
            any |= out[i];
        }
        return any;
    }
    if (W == 1) /* up to 64 workers: one word, not a call to memset */
        out[0] = 0;
    else
        for (uint32_t i = 0; i < W; i++)
            out[i] = 0;
    if (slot == KM_SLOT_NONE)
        return 0;
    const km_slot *s = km_view_slot(v, slot);
    for (uint32_t i = 0; i < KM_SLOT_INLINE; i++) {
        uint32_t w = s->ids[i];
        if (w == KM_SLOT_ID_EMPTY)
            break;
        uint64_t bit = (in[w >> 6] >> (w & 63)) & 1u;
        out[w >> 6] |= bit << (w & 63);
        any |= bit;
    }
    return any;
}

KM_HD static inline uint32_t km_bit_index(uint64_t word)
{
#if defined(__CUDA_ARCH__)
    return (uint32_t)(__ffsll((long long)word) - 1);
#else
    return (uint32_t)__builtin_ctzll(word);
#endif
}

/* depth_of[w] = depth for the workers w in word x of a set (the set bits of `bits`). A full word,
 * as when a shared prefix ends for every worker at once, is one fill. */
KM_HD static inline void km_walk_settle(uint32_t *depth_of, uint32_t x, uint64_t bits,
                                        uint32_t depth)
{
    if (bits == ~UINT64_C(0)) {
        uint32_t *word = depth_of + (size_t)x * 64u;
        for (uint32_t i = 0; i < 64; i++)
            word[i] = depth;
        return;
    }
    for (; bits; bits &= bits - 1)
        depth_of[x * 64u + km_bit_index(bits)] = depth;
}

/* One step of a block walk: look up block i (chain hash `key`), keep in `open` (W words) the
 * workers that hold it and settle the others at depth i (depth_of[w] = i). `tmp` is W words.
 * When some worker is settled, *owner / *owner_depth become the lowest of them and i: a walk
 * settles at increasing depths, so after its last step they name its deepest settled worker,
 * lowest id first. Returns nonzero when `open` is still not empty. */
KM_HD static inline uint64_t km_walk_block_step(const km_table_view *blocks, uint64_t key,
                                                uint32_t i, uint64_t *open, uint64_t *tmp,
                                                uint32_t *depth_of, uint32_t *owner,
                                                uint32_t *owner_depth)
{
    uint32_t W = blocks->words_per_set;
    uint64_t slot = km_view_find(blocks, key);
    uint64_t any = km_view_intersect(blocks, slot, open, tmp);
    uint32_t lowest = 0xFFFFFFFFu;
    for (uint32_t x = 0; x < W; x++) {
        uint64_t leaving = open[x] & ~tmp[x];
        if (leaving && lowest == 0xFFFFFFFFu)
            lowest = x * 64u + km_bit_index(leaving);
        km_walk_settle(depth_of, x, leaving, i);
        open[x] = tmp[x];
    }
    if (lowest != 0xFFFFFFFFu) {
        *owner = lowest;
        *owner_depth = i;
    }
    return any;
}

/* Walk blocks first..last (inclusive) for the workers in `open` (a bitmap of W words), settling each
 * at the first block it lacks (depth_of[w] = that position) and clearing it from `open`, with
 * *owner / *owner_depth as km_walk_block_step keeps them. Stops early when `open` empties. `tmp`
 * is W words. Returns the lookups made. */
KM_HD static inline uint32_t km_walk_blocks(const km_table_view *blocks, const uint64_t *hashes,
                                            uint32_t first, uint32_t last, uint64_t *open,
                                            uint64_t *tmp, uint32_t *depth_of, uint32_t *owner,
                                            uint32_t *owner_depth)
{
    uint32_t probes = 0;
    for (uint32_t i = first; i < first + KM_PREFETCH_AHEAD && i <= last; i++)
        km_view_prefetch(blocks, hashes[i]);
    for (uint32_t i = first; i <= last; i++) {
        if (i + KM_PREFETCH_AHEAD <= last)
            km_view_prefetch(blocks, hashes[i + KM_PREFETCH_AHEAD]);
        probes++;
        if (!km_walk_block_step(blocks, hashes[i], i, open, tmp, depth_of, owner, owner_depth))
            break;
    }
    return probes;
}

/* The first step of a walk: open (W words) = the holders of block 0, whose slot is slot0 (not
 * KM_SLOT_NONE). `tmp` is W words. */
KM_HD static inline void km_walk_open_holders(const km_table_view *blocks, uint64_t slot0,
                                              uint64_t *open, uint64_t *tmp)
{
    for (uint32_t i = 0; i < blocks->words_per_set; i++)
        tmp[i] = ~UINT64_C(0);
    km_view_intersect(blocks, slot0, tmp, open);
}

/* A segment key's lookup (`key`: the chain hash of the segment's last block): `kept` = the open
 * workers its set holds (they hold the whole segment), `open` = the rest, to be walked block by
 * block. Returns nonzero when the rest is not empty. */
KM_HD static inline uint64_t km_walk_segment_split(const km_table_view *segments, uint64_t key,
                                                   uint64_t *open, uint64_t *kept)
{
    uint64_t seg = km_view_find(segments, key);
    km_view_intersect(segments, seg, open, kept);
    uint64_t dropped = 0;
    for (uint32_t i = 0; i < segments->words_per_set; i++) {
        open[i] &= ~kept[i];
        dropped |= open[i];
    }
    return dropped;
}

/* After a segment's block walk: the workers it left open held the whole segment though the
 * segment key did not say so, and rejoin the kept ones. Returns nonzero when some worker is open. */
KM_HD static inline uint64_t km_walk_segment_rejoin(uint32_t W, uint64_t *open,
                                                    const uint64_t *kept)
{
    uint64_t any = 0;
    for (uint32_t i = 0; i < W; i++) {
        open[i] |= kept[i];
        any |= open[i];
    }
    return any;
}

/* Append worker w with its settled depth to a request's entries. */
KM_HD static inline void km_walk_emit(km_walk_entry *entries, uint32_t *m, uint32_t w,
                                      const uint32_t *depth_of)
{
    entries[*m].worker = w;
    entries[*m].depth = depth_of[w];
    (*m)++;
}

/* Entries written by km_walk_emit_word may be non-temporal stores (on the host with SSE2), which
 * are not ordered with the writer's later stores: a writer calls this before it signals another
 * thread that may read them, and before it returns them to its own caller. A no-op elsewhere. */
KM_HD static inline void km_walk_entries_fence(void)
{
#if !defined(__CUDACC__) && defined(__SSE2__)
    _mm_sfence();
#endif
}

/* km_walk_emit for the holders among workers base .. base + 63 (the set bits of `word`),
 * ascending. */
KM_HD static inline void km_walk_emit_word(uint64_t word, uint32_t base, const uint32_t *depth_of,
                                           km_walk_entry *entries, uint32_t *m)
{
#if !defined(__CUDACC__) && defined(__SSE2__)
    /* Every worker of the word holds block 0 (where a shared prefix reaches every worker): four
     * entries a step. Where the entries start 16-byte aligned they are written with non-temporal
     * stores (see km_walk_entries_fence): an answer at 1,024 workers is about 8 KB, a batch's
     * answers megabytes that no cache keeps until they are read, and a streaming store does not
     * first read the line it fills. */
    if (word == ~UINT64_C(0)) {
        const uint32_t *depth = depth_of + base;
        km_walk_entry *out = entries + *m;
        int streaming = ((uintptr_t)out & 15u) == 0;
        const __m128i step = _mm_set1_epi32(4);
        __m128i ids = _mm_setr_epi32((int)base, (int)base + 1, (int)base + 2, (int)base + 3);
        for (uint32_t i = 0; i < 64; i += 4) {
            __m128i d = _mm_loadu_si128((const __m128i *)(depth + i));
            if (streaming) {
                _mm_stream_si128((__m128i *)(out + i), _mm_unpacklo_epi32(ids, d));
                _mm_stream_si128((__m128i *)(out + i + 2), _mm_unpackhi_epi32(ids, d));
            } else {
                _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi32(ids, d));
                _mm_storeu_si128((__m128i *)(out + i + 2), _mm_unpackhi_epi32(ids, d));
            }
            ids = _mm_add_epi32(ids, step);
        }
        *m += 64;
        return;
    }
#endif
    for (; word; word &= word - 1)
        km_walk_emit(entries, m, base + km_bit_index(word), depth_of);
}

/* The last step of a walk of n blocks: the workers still open hold all n; then block 0's holders
 * (slot0), ascending, are written once each with their settled depth (fenced by the caller:
 * km_walk_entries_fence). *owner / *owner_depth come in as the walk's block steps left them (the
 * deepest settled worker, lowest id first) and go out naming the deepest of all: the lowest
 * worker still open, at depth n, when there is one. Returns the entry count. */
KM_HD static inline uint32_t km_walk_emit_all(const km_table_view *blocks, uint64_t slot0,
                                              uint32_t n, const uint64_t *open,
                                              uint32_t *depth_of, km_walk_entry *entries,
                                              uint32_t *owner, uint32_t *owner_depth)
{
    uint32_t W = blocks->words_per_set;
    uint32_t lowest_open = 0xFFFFFFFFu;
    for (uint32_t x = 0; x < W; x++) {
        if (open[x] && lowest_open == 0xFFFFFFFFu)
            lowest_open = x * 64u + km_bit_index(open[x]);
        km_walk_settle(depth_of, x, open[x], n);
    }
    if (lowest_open != 0xFFFFFFFFu) {
        *owner = lowest_open;
        *owner_depth = n;
    }
    const km_slot *s0 = km_view_slot(blocks, slot0);
    uint32_t m = 0;
    if (km_slot_is_shared(s0)) {
        const uint64_t *bits = blocks->pool + (uint64_t)km_slot_pool_index(s0) * W;
        for (uint32_t x = 0; x < W; x++)
            km_walk_emit_word(bits[x], x * 64u, depth_of, entries, &m);
        return m;
    }
    for (uint32_t i = 0; i < KM_SLOT_INLINE; i++)
        if (s0->ids[i] != KM_SLOT_ID_EMPTY)
            km_walk_emit(entries, &m, s0->ids[i], depth_of);
    return m;
}

/* The prefix walk for one request: for every worker holding block 0, the number of leading blocks
 * it holds (radix-tree find_matches semantics). Every backend must give exactly its results; the
 * CPU backend runs the same steps (km_walk_block_step, km_walk_segment_split, ...) for several
 * requests interleaved (src/index/cpu_backend.c).
 *
 * With segment keys (segment_blocks = S > 0), the segment table maps the chain hash of each
 * segment's last block (positions S-1, 2S-1, ...) to workers that certainly hold the whole segment
 * (a sound under-approximation, docs/ARCHITECTURE.md). Workers still open are checked one segment
 * key at a time; only those missing from a segment's set are walked block by block inside that
 * segment, and a worker that turns out to hold the whole segment anyway stays open. So the result
 * is exact whatever the segment table knows, and a request costs about n/S + S lookups. Worker sets
 * are bitmaps of ceil(max_workers / 64) words, intersected word by word, so a step costs the same
 * whether one worker or a thousand are open.
 *
 * entries: max_workers entries (out: ascending by worker, depth >= 1); scratch:
 * KM_WALK_SCRATCH_WORDS(max_workers) u64 words. Returns the entry count; *owner / *owner_depth get
 * the deepest worker (ties: lowest id) or 0xFFFFFFFF / 0; *probes gets the lookups. */
KM_HD static inline uint32_t km_walk_request(const km_table_view *blocks,
                                             const km_table_view *segments,
                                             uint32_t segment_blocks, const uint64_t *hashes,
                                             uint32_t n, km_walk_entry *entries, uint64_t *scratch,
                                             uint32_t max_workers, uint32_t *owner,
                                             uint32_t *owner_depth, uint32_t *probes)
{
    *owner = 0xFFFFFFFFu;
    *owner_depth = 0;
    *probes = 0;
    if (n == 0)
        return 0;
    uint32_t S = segment_blocks;
    uint32_t W = blocks->words_per_set;
    if (S > 0) {
        for (uint32_t k = 0; k < KM_PREFETCH_AHEAD && (k + 1) * S <= n; k++)
            km_view_prefetch(segments, hashes[(k + 1) * S - 1]);
        for (uint32_t k = KM_PREFETCH_AHEAD; k < 2u * KM_PREFETCH_AHEAD && k * S < n; k++)
            km_prefetch_segment_input(hashes, S, k, n);
    }

    uint64_t slot0 = km_view_find(blocks, hashes[0]);
    *probes = 1;
    if (slot0 == KM_SLOT_NONE)
        return 0;
    uint64_t *open = scratch;
    uint64_t *kept = scratch + W;
    uint64_t *tmp = scratch + 2u * W;
    uint32_t *depth_of = (uint32_t *)(scratch + 3u * W);
    (void)max_workers;
    km_walk_open_holders(blocks, slot0, open, tmp); /* the holders of block 0 */

    /* Invariant: every open worker holds blocks [0, next). */
    uint32_t next = 1;
    uint64_t any = 1;
    if (S > 0) {
        for (uint32_t k = 0; any && (k + 1) * S <= n; k++) {
            uint32_t last = (k + 1) * S - 1;
            if ((k + 1 + KM_PREFETCH_AHEAD) * S <= n)
                km_view_prefetch(segments, hashes[(k + 1 + KM_PREFETCH_AHEAD) * S - 1]);
            if ((k + 2u * KM_PREFETCH_AHEAD) * S < n)
                km_prefetch_segment_input(hashes, S, k + 2u * KM_PREFETCH_AHEAD, n);
            (*probes)++;
            if (km_walk_segment_split(segments, hashes[last], open, kept))
                *probes += km_walk_blocks(blocks, hashes, next, last, open, tmp, depth_of, owner,
                                          owner_depth);
            any = km_walk_segment_rejoin(W, open, kept);
            next = last + 1;
        }
    }
    if (any && next < n)
        *probes += km_walk_blocks(blocks, hashes, next, n - 1, open, tmp, depth_of, owner,
                                  owner_depth);
    uint32_t m = km_walk_emit_all(blocks, slot0, n, open, depth_of, entries, owner, owner_depth);
    km_walk_entries_fence();
    return m;
}

#endif
