/* SPDX-License-Identifier: Apache-2.0 */
/* Zeroed arrays with piecewise release, for incrementally growing tables. Contract in zeroed_pages.h. */
#include "base/zeroed_pages.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static uint64_t page_round(uint64_t bytes)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

void *km_pages_alloc(uint64_t bytes)
{
    if (bytes < KM_PAGES_PIECE)
        return calloc(1, bytes ? bytes : 1);
    if (bytes > UINT64_MAX - 2 * KM_PAGES_PIECE)
        return NULL; /* rounded up and over-mapped by a piece, its size would wrap */
    /* Over-map by one piece and trim, so the array starts on a piece boundary (pieces are given
     * back on those). Fresh anonymous pages read as zero. The mapping ends a whole piece past the
     * array's last page; the tail trimmed starts there, on a page boundary. */
    uint64_t mapped = page_round(bytes);
    uint8_t *raw = mmap(NULL, mapped + KM_PAGES_PIECE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uint64_t lead = (KM_PAGES_PIECE - (uintptr_t)raw % KM_PAGES_PIECE) % KM_PAGES_PIECE;
    if (lead)
        munmap(raw, lead);
    if (KM_PAGES_PIECE - lead)
        munmap(raw + lead + mapped, KM_PAGES_PIECE - lead);
    return raw + lead;
}

void *km_pages_grow(void *p, uint64_t bytes, uint64_t new_bytes)
{
    if (!p)
        return km_pages_alloc(new_bytes);
    if (new_bytes <= bytes)
        return p;
    uint8_t *q = km_pages_alloc(new_bytes);
    if (!q)
        return NULL;
    if (bytes < KM_PAGES_PIECE) { /* calloc'd: under one piece to copy */
        memcpy(q, p, bytes);
        free(p);
        return q;
    }
    /* Move the old pages onto the start of the new array (replacing its fresh pages there); the
     * rest of it stays fresh, zero. */
    uint64_t moved = page_round(bytes);
    if (mremap(p, moved, moved, MREMAP_MAYMOVE | MREMAP_FIXED, q) == MAP_FAILED) {
        km_pages_free(q, new_bytes);
        return NULL;
    }
    return q;
}

void km_pages_release(void *p, uint64_t bytes, uint64_t from, uint64_t to)
{
    if (!p || to <= from)
        return;
    if (bytes >= KM_PAGES_PIECE)
        munmap((uint8_t *)p + from, to - from);
    else if (from == 0 && to == bytes)
        free(p);
}

void km_pages_free(void *p, uint64_t bytes)
{
    km_pages_release(p, bytes, 0, bytes);
}

uint64_t km_pages_releasable(uint64_t bytes, uint64_t done)
{
    return bytes < KM_PAGES_PIECE ? 0 : done / KM_PAGES_PIECE * KM_PAGES_PIECE;
}

void km_pages_advise_huge(void *p, uint64_t bytes, int prefault)
{
    if (!p || bytes < KM_PAGES_PIECE)
        return;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    if (prefault) /* one write per 4 KiB page faults in (and clears) each page, or 2 MiB at once */
        for (uint64_t off = 0; off < bytes; off += 4096)
            ((volatile uint8_t *)p)[off] = 0;
}
