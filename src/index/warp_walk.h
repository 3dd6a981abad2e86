/* SPDX-License-Identifier: Apache-2.0 */
/* The per-request prefix walk for one warp of 32 lanes: the result km_walk_request
 * (src/index/slot_walk.h) gives, bit for bit (entries, owner, owner depth, lookups counted), with
 * the lookups spread over the lanes. Every function here is what one lane runs; the lanes run it
 * together, and the only traffic between them is km_lane_ballot, km_lane_shfl, and the warp's
 * scratch read across lanes after km_lane_sync. On the device those are the warp intrinsics and
 * __syncwarp; on the host they go through km_lane.exchange, which a warp
 * emulator provides (tests/warp_emulator.h steps 32 lanes through the very same code), so the
 * algorithm is checked against the CPU backend without a GPU.
 *
 * Contract for every caller: all 32 lanes call with the same arguments (only km_lane.id differs),
 * and every collective is reached by all 32 lanes, in the same order (control flow that decides
 * whether a collective is reached depends only on values every lane holds alike).
 *
 * How the walk uses the lanes:
 * - Block and segment keys are looked up 32 at a time, lane l taking key base + l, each slot read
 *   in one 16-byte load; a lane past the end of the range looks up nothing.
 * - Narrow sets (block 0's slot holds up to 4 workers inline, so no more are ever open): for each
 *   open worker a ballot over the 32 looked-up slots ("lane l's slot holds w") gives, by its first
 *   zero bit, the worker's first missing block in the group.
 * - Wide sets (block 0's slot has a bitmap): lane l owns bitmap words l, l + 32, ...; the group's
 *   slots are taken one at a time (broadcast by shuffle) and every lane updates its own words, so
 *   bitmap reads are coalesced and no lane touches another's words.
 * - Lookups are counted as the serial walk makes them: a group whose walk ends early at its j-th
 *   key counts j + 1, not 32.
 * Scratch (wide sets only): KM_WALK_SCRATCH_WORDS(max_workers) u64 words per warp, laid out as
 * [open: W words][kept: W words][unused: W words][depth per worker: u32], which the device keeps in
 * shared memory where it fits. */
#ifndef KM_WARP_WALK_H
#define KM_WARP_WALK_H

#include "index/slot_walk.h"

#define KM_WARP_LANES 32u

/* One lane of a warp. On the host, exchange posts this lane's value and returns once all 32 lanes
 * have posted theirs, with all[i] = lane i's value; the device never uses it. */
typedef struct km_lane {
    uint32_t id; /* 0 .. 31 */
    void (*exchange)(void *warp, uint32_t lane, uint64_t value, uint64_t all[KM_WARP_LANES]);
    void *warp;
} km_lane;

/* Bit l set when lane l's pred is nonzero. */
KM_HD static inline uint32_t km_lane_ballot(const km_lane *L, int pred)
{
#if defined(__CUDA_ARCH__)
    (void)L;
    return __ballot_sync(0xFFFFFFFFu, pred);
#else
    uint64_t all[KM_WARP_LANES];
    L->exchange(L->warp, L->id, pred != 0, all);
    uint32_t mask = 0;
    for (uint32_t i = 0; i < KM_WARP_LANES; i++)
        mask |= (uint32_t)(all[i] & 1u) << i;
    return mask;
#endif
}

/* Lane src's value (src < 32). */
KM_HD static inline uint64_t km_lane_shfl(const km_lane *L, uint64_t value, uint32_t src)
{
#if defined(__CUDA_ARCH__)
    (void)L;
    return (uint64_t)__shfl_sync(0xFFFFFFFFu, (unsigned long long)value, (int)src);
#else
    uint64_t all[KM_WARP_LANES];
    L->exchange(L->warp, L->id, value, all);
    return all[src];
#endif
}

/* A barrier for the warp's memory: every lane's writes to the warp's scratch before it are seen by
 * every lane after it. */
KM_HD static inline void km_lane_sync(const km_lane *L)
{
#if defined(__CUDA_ARCH__)
    (void)L;
    __syncwarp();
#else
    uint64_t all[KM_WARP_LANES];
    L->exchange(L->warp, L->id, 0, all);
#endif
}

KM_HD static inline uint32_t km_lane_popcount(uint64_t word)
{
#if defined(__CUDA_ARCH__)
    return (uint32_t)__popcll((unsigned long long)word);
#else
    return (uint32_t)__builtin_popcountll(word);
#endif
}

/* Index of the lowest zero bit of a ballot; 32 when all are set. */
KM_HD static inline uint32_t km_lane_first_zero(uint32_t ballot)
{
    return ballot == 0xFFFFFFFFu ? 32u : km_bit_index((uint64_t)~ballot & 0xFFFFFFFFu);
}

/* One slot in one 16-byte load (a read-only, vectorised load on the device). */
KM_HD static inline km_slot km_slot_load(const km_slot *p)
{
    km_slot s;
#if defined(__CUDA_ARCH__)
    ulonglong2 v = __ldg((const ulonglong2 *)p);
    s.key = v.x;
    s.ids[0] = (uint16_t)v.y;
    s.ids[1] = (uint16_t)(v.y >> 16);
    s.ids[2] = (uint16_t)(v.y >> 32);
    s.ids[3] = (uint16_t)(v.y >> 48);
#else
    s = *p;
#endif
    return s;
}

/* The slot of key `key` (an empty, zero slot when absent). */
KM_HD static inline km_slot km_view_lookup(const km_table_view *v, uint64_t key)
{
    uint64_t i = km_view_find(v, key);
    km_slot s = {0, {0, 0, 0, 0}};
    if (i != KM_SLOT_NONE)
        s = km_slot_load(km_view_slot(v, i));
    return s;
}

/* Lane src's slot, for every lane (two shuffles). */
KM_HD static inline km_slot km_lane_shfl_slot(const km_lane *L, const km_slot *s, uint32_t src)
{
    uint64_t ids = (uint64_t)s->ids[0] | (uint64_t)s->ids[1] << 16 | (uint64_t)s->ids[2] << 32 |
                   (uint64_t)s->ids[3] << 48;
    km_slot r;
    r.key = km_lane_shfl(L, s->key, src);
    ids = km_lane_shfl(L, ids, src);
    r.ids[0] = (uint16_t)ids;
    r.ids[1] = (uint16_t)(ids >> 16);
    r.ids[2] = (uint16_t)(ids >> 32);
    r.ids[3] = (uint16_t)(ids >> 48);
    return r;
}

/* Word x of the worker set of a slot read by km_view_lookup (an empty slot: no workers). */
KM_HD static inline uint64_t km_slot_word(const km_table_view *v, const km_slot *s, uint32_t x)
{
    if (s->key == KM_KEY_EMPTY)
        return 0;
    if (km_slot_is_shared(s))
        return v->pool[(uint64_t)km_slot_pool_index(s) * v->words_per_set + x];
    uint64_t word = 0;
    for (uint32_t i = 0; i < KM_SLOT_INLINE; i++) {
        uint32_t w = s->ids[i];
        if (w != KM_SLOT_ID_EMPTY && (w >> 6) == x)
            word |= UINT64_C(1) << (w & 63);
    }
    return word;
}

/* Does a slot read by km_view_lookup hold worker w? */
KM_HD static inline int km_slot_holds(const km_table_view *v, const km_slot *s, uint32_t w)
{
    return s->key != KM_KEY_EMPTY && km_slot_contains(s, v->pool, v->words_per_set, w);
}

/* Narrow sets: ids[0..4) are block 0's inline holders; bit k of `walking` is ids[k] still open.
 * Walks blocks first..last for them as km_walk_blocks does, settling depth[k]; returns the bits
 * still open after `last` (they hold every block of the range). Adds the lookups to *probes. */
KM_HD static inline uint32_t km_warp_walk_blocks_narrow(const km_lane *L, const km_table_view *blocks,
                                                        const uint64_t *hashes, uint32_t first,
                                                        uint32_t last, uint32_t walking,
                                                        const uint32_t ids[KM_SLOT_INLINE],
                                                        uint32_t depth[KM_SLOT_INLINE],
                                                        uint32_t *probes)
{
    for (uint32_t base = first; base <= last; base += KM_WARP_LANES) {
        uint32_t len = last - base + 1 < KM_WARP_LANES ? last - base + 1 : KM_WARP_LANES;
        km_slot s = {0, {0, 0, 0, 0}};
        if (L->id < len)
            s = km_view_lookup(blocks, hashes[base + L->id]);
        uint32_t used = 0; /* keys the serial walk would have looked up in this group */
        for (uint32_t k = 0; k < KM_SLOT_INLINE; k++) {
            if (!((walking >> k) & 1u))
                continue;
            uint32_t held = km_lane_ballot(L, L->id < len && km_slot_holds(blocks, &s, ids[k]));
            uint32_t miss = km_lane_first_zero(held);
            if (miss < len) {
                depth[k] = base + miss;
                walking &= ~(1u << k);
                if (miss + 1 > used)
                    used = miss + 1;
            }
        }
        if (!walking) {
            *probes += used;
            return 0;
        }
        *probes += len;
        if (last - base < KM_WARP_LANES) /* also ends the loop before base + 32 could wrap */
            break;
    }
    return walking;
}

/* Wide sets: walks blocks first..last for the workers in open (W words, this lane's words only),
 * settling depth_of[w] and clearing them from open as km_walk_blocks does. Returns nonzero when
 * some worker is still open after `last`. Adds the lookups to *probes. */
KM_HD static inline int km_warp_walk_blocks_wide(const km_lane *L, const km_table_view *blocks,
                                                 const uint64_t *hashes, uint32_t first,
                                                 uint32_t last, uint64_t *open, uint32_t *depth_of,
                                                 uint32_t *probes)
{
    uint32_t W = blocks->words_per_set;
    for (uint32_t base = first; base <= last; base += KM_WARP_LANES) {
        uint32_t len = last - base + 1 < KM_WARP_LANES ? last - base + 1 : KM_WARP_LANES;
        km_slot mine = {0, {0, 0, 0, 0}};
        if (L->id < len)
            mine = km_view_lookup(blocks, hashes[base + L->id]);
        for (uint32_t j = 0; j < len; j++) {
            km_slot s = km_lane_shfl_slot(L, &mine, j);
            uint64_t left = 0;
            for (uint32_t x = L->id; x < W; x += KM_WARP_LANES) {
                uint64_t was = open[x], now = was & km_slot_word(blocks, &s, x);
                for (uint64_t settled = was & ~now; settled; settled &= settled - 1)
                    depth_of[x * 64u + km_bit_index(settled)] = base + j;
                open[x] = now;
                left |= now;
            }
            if (!km_lane_ballot(L, left != 0)) {
                *probes += j + 1;
                return 0;
            }
        }
        *probes += len;
        if (last - base < KM_WARP_LANES)
            break;
    }
    return 1;
}

/* Lane-wide owner choice: the deepest entry, ties to the lowest worker, as one comparable key. */
KM_HD static inline uint64_t km_owner_key(uint32_t worker, uint32_t depth)
{
    return (uint64_t)depth << 32 | (uint64_t)(0xFFFFFFFFu - worker);
}

KM_HD static inline uint64_t km_lane_max(const km_lane *L, uint64_t v)
{
    for (uint32_t d = 1; d < KM_WARP_LANES; d <<= 1) {
        uint64_t other = km_lane_shfl(L, v, L->id ^ d);
        if (other > v)
            v = other;
    }
    return v;
}

/* The walk of one request by one warp: km_walk_request's contract (src/index/slot_walk.h), with
 * scratch per warp as described at the top of this file. Every lane returns the entry count and
 * gets *owner, *owner_depth and *probes; the entries are written across the lanes (lane 0 alone
 * for narrow sets), so they are complete once every lane has returned. */
KM_HD static inline uint32_t km_warp_walk_request(const km_lane *L, const km_table_view *blocks,
                                                  const km_table_view *segments,
                                                  uint32_t segment_blocks, const uint64_t *hashes,
                                                  uint32_t n, km_walk_entry *entries,
                                                  uint64_t *scratch, uint32_t *owner,
                                                  uint32_t *owner_depth, uint32_t *probes)
{
    *owner = 0xFFFFFFFFu;
    *owner_depth = 0;
    *probes = 0;
    if (n == 0)
        return 0;
    const uint32_t S = segment_blocks, W = blocks->words_per_set;
    const uint32_t n_segments = S > 0 ? n / S : 0; /* segments k with (k + 1) * S <= n */
    km_slot s0 = km_view_lookup(blocks, hashes[0]); /* the same address for every lane */
    *probes = 1;
    if (s0.key == KM_KEY_EMPTY)
        return 0;

    if (!km_slot_is_shared(&s0)) {
        /* ---- narrow: at most 4 workers, held alike by every lane ---- */
        uint32_t ids[KM_SLOT_INLINE], depth[KM_SLOT_INLINE], open = 0;
        for (uint32_t k = 0; k < KM_SLOT_INLINE; k++) {
            ids[k] = s0.ids[k];
            depth[k] = n;
            if (ids[k] != KM_SLOT_ID_EMPTY)
                open |= 1u << k;
        }
        uint32_t next = 1;
        for (uint32_t kbase = 0; open && kbase < n_segments; kbase += KM_WARP_LANES) {
            uint32_t len = n_segments - kbase < KM_WARP_LANES ? n_segments - kbase : KM_WARP_LANES;
            km_slot mine = {0, {0, 0, 0, 0}};
            if (L->id < len)
                mine = km_view_lookup(segments, hashes[(kbase + L->id + 1) * S - 1]);
            for (uint32_t j = 0; open && j < len; j++) {
                km_slot seg = km_lane_shfl_slot(L, &mine, j);
                uint32_t last = (kbase + j + 1) * S - 1;
                (*probes)++;
                uint32_t kept = 0;
                for (uint32_t k = 0; k < KM_SLOT_INLINE; k++)
                    if (((open >> k) & 1u) && km_slot_holds(segments, &seg, ids[k]))
                        kept |= 1u << k;
                uint32_t dropped = open & ~kept;
                if (dropped)
                    dropped = km_warp_walk_blocks_narrow(L, blocks, hashes, next, last, dropped,
                                                         ids, depth, probes);
                open = kept | dropped;
                next = last + 1;
            }
        }
        if (open && next < n)
            km_warp_walk_blocks_narrow(L, blocks, hashes, next, n - 1, open, ids, depth, probes);
        uint32_t m = 0;
        for (uint32_t k = 0; k < KM_SLOT_INLINE; k++) {
            if (ids[k] == KM_SLOT_ID_EMPTY)
                continue;
            if (L->id == 0) {
                entries[m].worker = ids[k];
                entries[m].depth = depth[k];
            }
            m++;
            if (depth[k] > *owner_depth) {
                *owner_depth = depth[k];
                *owner = ids[k];
            }
        }
        return m;
    }

    /* ---- wide: bitmaps, lane l owning words l, l + 32, ... ---- */
    uint64_t *open = scratch;
    uint64_t *kept = scratch + W;
    uint32_t *depth_of = (uint32_t *)(scratch + 3u * W);
    const uint64_t *holders = blocks->pool + (uint64_t)km_slot_pool_index(&s0) * W;
    for (uint32_t x = L->id; x < W; x += KM_WARP_LANES)
        open[x] = holders[x];
    uint32_t next = 1;
    int any = 1;
    for (uint32_t kbase = 0; any && kbase < n_segments; kbase += KM_WARP_LANES) {
        uint32_t len = n_segments - kbase < KM_WARP_LANES ? n_segments - kbase : KM_WARP_LANES;
        km_slot mine = {0, {0, 0, 0, 0}};
        if (L->id < len)
            mine = km_view_lookup(segments, hashes[(kbase + L->id + 1) * S - 1]);
        for (uint32_t j = 0; any && j < len; j++) {
            km_slot seg = km_lane_shfl_slot(L, &mine, j);
            uint32_t last = (kbase + j + 1) * S - 1;
            (*probes)++;
            uint64_t dropped = 0;
            for (uint32_t x = L->id; x < W; x += KM_WARP_LANES) {
                uint64_t k = open[x] & km_slot_word(segments, &seg, x);
                kept[x] = k;
                open[x] &= ~k; /* open now holds the dropped workers */
                dropped |= open[x];
            }
            if (km_lane_ballot(L, dropped != 0))
                km_warp_walk_blocks_wide(L, blocks, hashes, next, last, open, depth_of, probes);
            uint64_t left = 0;
            for (uint32_t x = L->id; x < W; x += KM_WARP_LANES) {
                open[x] |= kept[x];
                left |= open[x];
            }
            any = km_lane_ballot(L, left != 0) != 0;
            next = last + 1;
        }
    }
    if (any && next < n)
        km_warp_walk_blocks_wide(L, blocks, hashes, next, n - 1, open, depth_of, probes);
    for (uint32_t x = L->id; x < W; x += KM_WARP_LANES)
        for (uint64_t left = open[x]; left; left &= left - 1)
            depth_of[x * 64u + km_bit_index(left)] = n;

    /* Block 0's holders, ascending, one word at a time, every lane reading the same word: lane l
     * writes the entries of bits l and 32 + l, each placed after the word's set bits below it, so
     * a full word's 64 entries go out as two stores of consecutive entries across the warp. A
     * lane reads depths other lanes settled (each settled only its own words): sync first. */
    km_lane_sync(L);
    uint32_t m = 0;
    uint64_t best = 0;
    const uint32_t below = (1u << L->id) - 1u; /* this lane's lower bits of a half word */
    for (uint32_t x = 0; x < W; x++) {
        uint64_t word = holders[x];
        if (!word)
            continue;
        uint32_t halves[2] = {(uint32_t)word, (uint32_t)(word >> 32)};
        uint32_t before = m;
        for (uint32_t h = 0; h < 2; h++) {
            if ((halves[h] >> L->id) & 1u) {
                uint32_t w = x * 64u + h * 32u + L->id;
                uint32_t at = before + km_lane_popcount(halves[h] & below);
                entries[at].worker = w;
                entries[at].depth = depth_of[w];
                uint64_t key = km_owner_key(w, depth_of[w]);
                if (key > best)
                    best = key;
            }
            before += km_lane_popcount(halves[h]);
        }
        m = before;
    }
    best = km_lane_max(L, best);
    if (best) {
        *owner_depth = (uint32_t)(best >> 32);
        *owner = 0xFFFFFFFFu - (uint32_t)best;
    }
    return m;
}

#endif
