/* SPDX-License-Identifier: Apache-2.0 */
/* Zeroed arrays for the hash tables that grow incrementally (src/index/host_table.c,
 * src/base/u64_map.c) and for the large arrays that grow by doubling (approximate mode's slab, a
 * table's bitmap pool, the anchor lists' nodes): large ones come straight from the kernel, so
 * nothing is cleared up front, a growth can hand the moved part of its previous array back a piece
 * at a time (unmapping a few hundred MiB in one call takes tens of milliseconds: the pause
 * incremental growth is there to avoid), and a doubling moves pages rather than copying them. */
#ifndef KM_PAGES_H
#define KM_PAGES_H

#include <stdint.h>

/* Arrays of at least this many bytes are mapped directly, start on a boundary of it, and are given
 * back in whole pieces of it; smaller ones come from calloc and are only ever freed whole. */
#define KM_PAGES_PIECE (UINT64_C(2) << 20)

/* `bytes` of zeroed memory, or NULL (also for a size within two pieces of 2^64, which no mapping
 * holds). Mapped arrays are not advised as huge pages (see
 * km_pages_advise_huge): their 4 KiB pages are cleared by the kernel as they are first written. */
void *km_pages_alloc(uint64_t bytes);
/* The array p of `bytes` (from km_pages_alloc or this; NULL: none yet) as an array of new_bytes
 * (>= bytes) holding the same first `bytes`, the rest zeroed; p is then gone. NULL when out of
 * memory, p left as it was. A mapped array's pages move to the new place without being copied, so
 * the call costs the same however large the array is (a realloc under an allocator that copies
 * large blocks, as jemalloc does, copies the whole array). */
void *km_pages_grow(void *p, uint64_t bytes, uint64_t new_bytes);
/* Give back bytes [from, to) of an array of `bytes` from km_pages_alloc: for a mapped array, `from`
 * and `to` are multiples of KM_PAGES_PIECE (or `to` = bytes); a calloc'd one is freed only when the
 * range is the whole array. The range is not read or written afterwards. */
void km_pages_release(void *p, uint64_t bytes, uint64_t from, uint64_t to);
/* The whole array (NULL is ignored). */
void km_pages_free(void *p, uint64_t bytes);
/* Of the first `done` bytes (moved out and never read again), the whole pieces: what
 * km_pages_release may give back. 0 for a calloc'd array. */
uint64_t km_pages_releasable(uint64_t bytes, uint64_t done);
/* Ask for transparent huge pages on a mapped array (best effort; no effect on a calloc'd one).
 * prefault: write every page now, so the clearing happens here rather than on first use. */
void km_pages_advise_huge(void *p, uint64_t bytes, int prefault);

#endif
