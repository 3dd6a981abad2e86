/* SPDX-License-Identifier: Apache-2.0 */
/* The index handle and its update planner.
 *
 * Updates apply to the host tables (the authoritative state) in order. The planner keeps three
 * things exact or sound:
 *  - block sets: exactly which workers hold each chain hash, and per-worker counters;
 *  - segment keys: for the chain hash e of a segment's last block (positions S-1, 2S-1, ...), a set
 *    of workers that certainly hold all S blocks of that segment. A worker joins when it stores e
 *    and holds the S-1 blocks before it on e's chain (checked by walking back through each block's
 *    parent, found by the parent tag in its metadata: src/index/host_table.h); it
 *    leaves when it removes any of those blocks (found through the anchor list of the segment's
 *    first block) or is cleared. Out-of-order stores may leave a worker out: scoring then walks that
 *    segment block by block, so results stay exact (src/index/slot_walk.h, km_walk_request);
 *  - all-or-nothing batches: every mutation of a batch that may allocate is logged, and a failure
 *    (memory cap, out of memory) undoes the log in reverse. Undo never allocates: undoing in
 *    reverse only ever restores a key set the table held earlier in the batch, under its maximum
 *    load, and the capacity never shrinks, so a re-insert always finds an empty slot; each step
 *    also restores the set's form (inline or bitmap, logged since a set of 4 may have either), so
 *    a bitmap an undone promotion held is free again before an undone demotion takes one back (a
 *    form left different once made a later step need a bitmap at the cap and drop a worker
 *    instead). Undo finds every key again by hash: erases shift slots (src/index/host_table.h), so no slot
 *    index is kept across them.
 * After a batch the backend's replica is synced; a CUDA failure moves the index to the CPU backend. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "index/index_internal.h"
#include "base/log_level.h"
#include "base/array.h"
#include "kvmatch/log.h"
#include "kvmatch/hash.h"
#include "base/error_detail.h"
#include "base/zeroed_pages.h"

#define ANCHOR_NONE UINT32_MAX


/* ---- errors and logging ---------------------------------------------------------------------- */

int km_index_fail(km_index *index, int status, const char *fmt, ...)
{
    if (!index)
        return status;
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(index->last_error, sizeof index->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

void km_index_log(const km_index *index, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (index && index->config.log)
        index->config.log(index->config.log_user, line);
    else
        fprintf(stderr, "kvmatch: %s\n", line + km_log_level_length(line));
}

const char *km_index_last_error(const km_index *index)
{
    return index ? index->last_error : "";
}

const char *km_index_backend_name(const km_index *index)
{
    return index && index->backend ? index->backend->name : "none";
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

void km_index_config_init(km_index_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->max_workers = 1024;
    cfg->segment_blocks = 32;
    cfg->initial_blocks = 1u << 16;
    cfg->max_request_blocks = 1u << 20;
    cfg->backend = KM_BACKEND_AUTO;
}

static int select_backend(km_index *index)
{
    char why[256] = "";
    km_backend_kind kind = index->config.backend;
    if (kind == KM_BACKEND_CUDA) { /* only when named: AUTO is the CPU backend (index.h) */
#if KM_HAVE_CUDA
        int rc = km_backend_cuda.create(index, &index->backend_state, why, sizeof why);
        if (rc == KM_OK) {
            index->backend = &km_backend_cuda;
            return KM_OK;
        }
        /* The caller gets no index to ask km_index_last_error: the log line keeps the reason. */
        km_index_log(index, KM_LOG_WARNING
                     "backend: cuda unavailable (%s): %s", km_error_name(rc), why);
        return km_index_fail(index, rc, "cuda backend unavailable: %s", why);
#else
        snprintf(why, sizeof why, "built without CUDA (nvcc absent or CUDA=0)");
        km_index_log(index, KM_LOG_WARNING "backend: cuda unavailable (%s): %s",
                     km_error_name(KM_ERR_BACKEND_UNAVAILABLE), why);
        return km_index_fail(index, KM_ERR_BACKEND_UNAVAILABLE, "cuda backend unavailable: %s", why);
#endif
    }
    int rc = km_backend_cpu.create(index, &index->backend_state, why, sizeof why);
    if (rc)
        return km_index_fail(index, rc, "cpu backend: %s", why);
    index->backend = &km_backend_cpu;
    if (kind == KM_BACKEND_AUTO)
        km_index_log(index, KM_LOG_INFO
                     "backend: cpu (auto: it scores faster than the CUDA backend, which is used "
                     "only when named)");
    return KM_OK;
}

static void set_dirty_tracking(km_index *index)
{
    int on = index->backend && index->backend->needs_dirty_tracking;
    index->blocks.track_dirty = on;
    index->segments.track_dirty = on;
    km_table_clear_dirty(&index->blocks);
    km_table_clear_dirty(&index->segments);
}

int km_index_create(const km_index_config *cfg_in, km_index **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_index_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        km_index_config_init(&cfg);
    if (cfg.max_workers == 0 || cfg.max_workers > KM_MAX_WORKERS_LIMIT ||
        cfg.segment_blocks > KM_MAX_SEGMENT_BLOCKS || cfg.max_request_blocks == 0 ||
        cfg.max_request_blocks > KM_MAX_REQUEST_BLOCKS_LIMIT ||
        cfg.backend < KM_BACKEND_AUTO || cfg.backend > KM_BACKEND_CUDA)
        return KM_ERR_INVALID_ARGUMENT;
    if (cfg.threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        cfg.threads = n > 0 ? (uint32_t)n : 1;
    }
    km_index *index = calloc(1, sizeof *index);
    if (!index)
        return KM_ERR_OUT_OF_MEMORY;
    index->config = cfg;
    index->memory.cap = cfg.memory_cap_bytes;
    index->anchor_free_head = ANCHOR_NONE;
    index->replica_growth_step = KM_REPLICA_GROWTH_STEP_SLOTS;
    index->replica_growth_budget_ms = KM_REPLICA_GROWTH_BUDGET_MS;
    index->host_ops = &km_backend_cpu;
    km_u64map_init(&index->anchors, &index->memory);
    int rc = km_table_init(&index->blocks, cfg.initial_blocks, cfg.max_workers, 1, 0, &index->memory);
    if (!rc) /* aux: one fingerprint byte per block of each segment key */
        rc = km_table_init(&index->segments,
                           cfg.segment_blocks ? cfg.initial_blocks / cfg.segment_blocks + 1 : 1,
                           cfg.max_workers, 0, cfg.segment_blocks, &index->memory);
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT && !rc; t++)
        rc = km_table_init(&index->lower[t], 16, cfg.max_workers, 0, 0, &index->memory);
    if (!rc) {
        index->workers = calloc(cfg.max_workers, sizeof *index->workers);
        if (!index->workers)
            rc = KM_ERR_OUT_OF_MEMORY;
    }
    if (!rc)
        rc = select_backend(index);
    if (rc) {
        km_index_destroy(index);
        return rc;
    }
    set_dirty_tracking(index);
    *out = index;
    return KM_OK;
}

void km_index_destroy(km_index *index)
{
    if (!index)
        return;
    if (index->backend)
        index->backend->destroy(index->backend_state);
    km_backend_cpu.destroy(index->host_scorer);
    km_table_free(&index->blocks);
    km_table_free(&index->segments);
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++)
        km_table_free(&index->lower[t]);
    km_u64map_free(&index->anchors);
    km_pages_free(index->anchor_nodes,
                  (uint64_t)index->anchor_nodes_capacity * sizeof *index->anchor_nodes);
    free(index->workers);
    free(index->undo_log);
    free(index->undo_saved);
    free(index->undo_touched);
    free(index->open_segments);
    free(index->open_fingerprints);
    free(index->window_rules);
    free(index);
}

/* Move to the CPU backend after a CUDA failure; the host tables are complete, so nothing is lost.
 * The CPU backend is made before the failed one is destroyed: when it cannot be made (out of host
 * memory), the index keeps its backend, whose next call fails again and retries this, and the
 * status (KM_ERR_OUT_OF_MEMORY, detail in last_error) goes to the caller. The index never has no
 * backend. */
static int fall_back_to_cpu(km_index *index, int status, const char *what)
{
    char detail[256];
    snprintf(detail, sizeof detail, "%s", index->last_error);
    char why[256] = "";
    void *state = NULL;
    int rc = KM_OK;
    if (index->host_scorer) { /* already scoring on the host while a growth lasts: keep it */
        state = index->host_scorer;
        index->host_scorer = NULL;
    } else {
        rc = index->host_ops->create(index, &state, why, sizeof why);
    }
    if (rc != KM_OK) {
        km_index_log(index, KM_LOG_ERROR
                     "backend %s: %s failed with %s (%s); no cpu backend to fall back to: "
                     "%s %s", index->backend->name, what, km_error_name(status), detail,
                     km_error_name(rc), why);
        return km_index_fail(index, rc, "%s failed with %s (%s) and the cpu backend could not be "
                             "created: %s %s", what, km_error_name(status), detail,
                             km_error_name(rc), why);
    }
    index->backend->destroy(index->backend_state);
    index->backend_state = state;
    index->backend = &km_backend_cpu;
    index->replica_stale = 0;
    index->backend_failed = 0;
    set_dirty_tracking(index);
    km_index_log(index, KM_LOG_WARNING
                 "backend: cpu (fallback: %s failed with %s: %s)", what, km_error_name(status),
                 detail);
    return KM_OK;
}

static void sync_backend(km_index *index);

/* The CPU backend a replica's index keeps for scoring on the host (a table growing, a failed sync
 * or match), created on first need and kept. False when it cannot be had (why says why). */
static bool have_host_scorer(km_index *index, char *why, size_t why_size)
{
    if (!index->host_scorer &&
        index->host_ops->create(index, &index->host_scorer, why, why_size) != KM_OK)
        index->host_scorer = NULL;
    return index->host_scorer != NULL;
}

int km_index_use_backend(km_index *index, const km_backend_ops *ops, char *why, size_t why_size)
{
    if (!index || !ops)
        return KM_ERR_NULL_POINTER;
    km_table_finish_growth(&index->blocks);
    km_table_finish_growth(&index->segments);
    const km_backend_ops *old_ops = index->backend;
    void *old_state = index->backend_state;
    void *state = NULL;
    int rc = ops->create(index, &state, why, why_size);
    /* On failure the old backend stays with what its next sync still owes it (dirty lists, the
     * finished move's layout_changed, replica_stale), so nothing is cleared before this point. */
    if (rc)
        return rc;
    index->backend = ops;
    index->backend_state = state;
    index->replica_stale = 0;
    set_dirty_tracking(index); /* the new backend was made from the tables as they are */
    if (old_ops)
        old_ops->destroy(old_state);
    return KM_OK;
}

/* ---- undo log -------------------------------------------------------------------------------- */

typedef enum undo_kind {
    UNDO_BLOCK_ADDED,    /* worker was added to key's block set (key may have been new) */
    UNDO_BLOCK_REMOVED,  /* worker was removed; meta holds the block's metadata */
    UNDO_BLOCK_META,     /* meta of key was overwritten; meta holds the old value */
    UNDO_SEG_ADDED,
    UNDO_SEG_REMOVED,
    UNDO_ANCHOR_LINKED,  /* key (segment end) was linked under anchor tag aux */
    UNDO_ANCHOR_UNLINKED,
    UNDO_WORKER_COUNTERS, /* worker's counters before the batch: index->undo_saved[aux] */
    UNDO_TIER_ADDED,      /* worker was added to key's set in lower tier table aux */
    UNDO_TIER_REMOVED,    /* worker was removed from key's set in lower tier table aux */
} undo_kind;

/* 32 bytes: a store logs one or two per block, so the entry stays small (a worker's counters,
 * 128 bytes, are saved once per batch in index->undo_saved instead). */
typedef struct km_undo_entry {
    uint16_t kind;     /* undo_kind */
    /* *_ADDED: the add promoted the set to a bitmap; *_REMOVED: the remove demoted it inline. The
     * undo moves it back: with the demotion's hysteresis the count alone does not say which form
     * a set of 4 had, and a form left different could make a later undo step need a bitmap that
     * is not there (a worker silently dropped at the memory cap). */
    uint16_t reshaped;
    uint32_t worker;
    uint64_t key;
    uint64_t aux;
    union {
        km_block_meta meta;
    } u;
} undo_entry;
_Static_assert(sizeof(undo_entry) == 32, "undo entries stay 32 bytes");

typedef struct batch {
    km_index *index;
    km_update_stats *stats;
    int logging;
    size_t n_log;   /* entries in index->undo_log */
    size_t n_saved; /* entries in index->undo_saved */
} batch;

/* A log up to this many entries is always kept for the next batch. A larger one is kept while
 * logging batches fill at least a quarter of it (a stream of large batches does not grow, copy and
 * fault in a fresh log each time) and given back after the first logging batch that uses less. */
#define UNDO_KEEP_ENTRIES (UINT64_C(1) << 16)

/* Room for one more entry in the log of a logging batch: the entry to write next, counted by
 * the caller (b->n_log++) once written; NULL when out of memory. */
static inline undo_entry *undo_next(batch *b)
{
    km_index *index = b->index;
    if (KM_ARRAY_GROW(index->undo_log, index->undo_capacity, b->n_log + 1, 1024))
        return NULL;
    return &index->undo_log[b->n_log];
}

/* Inline: the caller's entry is then written straight into the log. */
static inline int undo_push(batch *b, const undo_entry *e)
{
    if (!b->logging)
        return KM_OK;
    km_index *index = b->index;
    if (KM_ARRAY_GROW(index->undo_log, index->undo_capacity, b->n_log + 1, 1024))
        return KM_ERR_OUT_OF_MEMORY;
    index->undo_log[b->n_log++] = *e;
    return KM_OK;
}

/* Log a worker's counters the first time the batch touches it. Call before changing them. */
static int touch_worker_first(batch *b, uint32_t worker);

static inline int touch_worker(batch *b, uint32_t worker)
{
    if (!b->logging || b->index->undo_touched[worker])
        return KM_OK;
    return touch_worker_first(b, worker);
}

static int touch_worker_first(batch *b, uint32_t worker)
{
    km_index *index = b->index;
    if (KM_ARRAY_GROW(index->undo_saved, index->undo_saved_capacity, b->n_saved + 1, 16))
        return KM_ERR_OUT_OF_MEMORY;
    undo_entry e = {.kind = UNDO_WORKER_COUNTERS, .worker = worker, .aux = b->n_saved};
    int rc = undo_push(b, &e);
    if (rc)
        return rc;
    index->undo_saved[b->n_saved].worker = worker;
    index->undo_saved[b->n_saved++].counters = index->workers[worker];
    index->undo_touched[worker] = 1;
    return KM_OK;
}

/* ---- anchor lists: segment first block -> segment ends with a non-empty set ------------------- */

static int anchor_node_alloc(km_index *index, uint32_t *out)
{
    if (index->anchor_free_head != ANCHOR_NONE) {
        *out = index->anchor_free_head;
        index->anchor_free_head = index->anchor_nodes[*out].next;
        return KM_OK;
    }
    if (index->anchor_nodes_high == index->anchor_nodes_capacity) {
        uint64_t cap = index->anchor_nodes_capacity ? (uint64_t)index->anchor_nodes_capacity * 2 : 256;
        if (cap >= ANCHOR_NONE)
            return KM_ERR_MEMORY_CAP;
        size_t node = sizeof *index->anchor_nodes;
        int rc = km_memory_reserve(&index->memory, index->anchor_nodes_capacity * node, cap * node);
        if (rc)
            return rc;
        void *grown = km_pages_grow(index->anchor_nodes, index->anchor_nodes_capacity * node,
                                    cap * node); /* pages moved, not copied */
        if (!grown) {
            km_memory_reserve(&index->memory, cap * node, index->anchor_nodes_capacity * node);
            return KM_ERR_OUT_OF_MEMORY;
        }
        index->anchor_nodes = grown;
        index->anchor_nodes_capacity = (uint32_t)cap;
    }
    *out = index->anchor_nodes_high++;
    return KM_OK;
}

/* The anchor map's key for a segment's first block, from its tag (km_anchor_tag): the map reserves
 * keys 0 and 1, which a tag may take. */
static uint64_t anchor_key(uint32_t anchor_tag)
{
    return km_u64map_key(anchor_tag);
}

static int anchor_link(km_index *index, uint32_t anchor_tag, uint64_t end, int allow_grow)
{
    uint64_t anchor = anchor_key(anchor_tag);
    uint64_t *head = km_u64map_find(&index->anchors, anchor);
    if (!head && allow_grow) { /* reserve the map entry first so a failure leaves no orphan node */
        int rc = km_u64map_reserve(&index->anchors, 1);
        if (rc)
            return rc;
    }
    uint32_t node;
    int rc = anchor_node_alloc(index, &node);
    if (rc)
        return rc;
    head = km_u64map_find(&index->anchors, anchor);
    index->anchor_nodes[node].end = end;
    index->anchor_nodes[node].next = head ? (uint32_t)*head : ANCHOR_NONE;
    if (head) {
        *head = node;
        return KM_OK;
    }
    rc = km_u64map_put(&index->anchors, anchor, node, 0);
    if (rc) { /* unreachable after the reserve above; keep the node pool consistent anyway */
        index->anchor_nodes[node].next = index->anchor_free_head;
        index->anchor_free_head = node;
    }
    return rc;
}

static void anchor_unlink(km_index *index, uint32_t anchor_tag, uint64_t end)
{
    uint64_t anchor = anchor_key(anchor_tag);
    uint64_t *head = km_u64map_find(&index->anchors, anchor);
    if (!head)
        return;
    uint32_t prev = ANCHOR_NONE;
    for (uint32_t n = (uint32_t)*head; n != ANCHOR_NONE; prev = n, n = index->anchor_nodes[n].next) {
        if (index->anchor_nodes[n].end != end)
            continue;
        uint32_t next = index->anchor_nodes[n].next;
        if (prev == ANCHOR_NONE)
            *head = next;
        else
            index->anchor_nodes[prev].next = next;
        index->anchor_nodes[n].next = index->anchor_free_head;
        index->anchor_free_head = n;
        if (*head == ANCHOR_NONE)
            km_u64map_erase(&index->anchors, anchor);
        return;
    }
}

/* ---- raw set changes with undo logging --------------------------------------------------------- */

static km_table *undo_table(km_index *index, const undo_entry *e)
{
    if (e->kind == UNDO_TIER_ADDED || e->kind == UNDO_TIER_REMOVED)
        return &index->lower[e->aux];
    return e->kind == UNDO_SEG_ADDED || e->kind == UNDO_SEG_REMOVED ? &index->segments
                                                                    : &index->blocks;
}

/* Write at e the undo entry that reverses adding (added = 1) or removing worker from key's set in
 * t (written in place: the log's entries are what a batch writes most). */
static inline void undo_set_for(undo_entry *e, const km_index *index, const km_table *t, int added,
                                uint32_t worker, uint64_t key)
{
    *e = (undo_entry){.worker = worker, .key = key};
    if (t == &index->blocks) {
        e->kind = added ? UNDO_BLOCK_ADDED : UNDO_BLOCK_REMOVED;
    } else if (t == &index->segments) {
        e->kind = added ? UNDO_SEG_ADDED : UNDO_SEG_REMOVED;
    } else {
        e->kind = added ? UNDO_TIER_ADDED : UNDO_TIER_REMOVED;
        e->aux = (uint64_t)(t - index->lower);
    }
}

static double monotonic_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static const char *table_name(const km_index *index, const km_table *t)
{
    if (t == &index->blocks)
        return "block";
    if (t == &index->segments)
        return "segment";
    return t == &index->lower[KM_TIER_HOST - 1] ? "host-tier" : "disk-tier";
}

/* A pause for growth: the insert that grew a table (a small one rehashes at once; a large one only
 * allocates, and its keys move over the next inserts), or a device sync that finished a move. */
static void note_growth_pause(km_index *index, double ms)
{
    index->table_growth_ms_total += ms;
    if (ms > index->table_growth_ms_max)
        index->table_growth_ms_max = ms;
}

/* A table just grew: count it and say so, since the remedy (sizing the index at start) is the
 * operator's. */
static void note_growth(km_index *index, const km_table *t, uint64_t from, double ms)
{
    index->table_growths++;
    note_growth_pause(index, ms);
    km_index_log(index,
                 KM_LOG_INFO
                 "%s table grew from %" PRIu64 " to %" PRIu64 " slots (%.1f ms in the insert that "
                 "grew it%s); initial_blocks sizes the index at start",
                 table_name(index, t), from, t->capacity, ms,
                 t->old_slots ? "; its keys move to the new slots over the next inserts" : "");
}

/* Add worker to key's set in table t (inserting the key if absent). Returns 1 added, 0 present. */
__attribute__((always_inline)) static inline int table_add(batch *b, km_table *t, uint64_t key,
                                                          uint32_t worker, uint64_t *slot_out,
                                                          int *inserted)
{
    uint64_t vacant;
    uint64_t slot = km_table_find_vacant(t, key, &vacant);
    *inserted = 0;
    if (slot != KM_SLOT_NONE && km_table_set_contains(t, slot, worker)) {
        *slot_out = slot;
        return 0;
    }
    /* Log first: if logging fails nothing has changed yet. */
    if (b->logging) {
        undo_entry *e = undo_next(b);
        if (!e)
            return KM_ERR_OUT_OF_MEMORY;
        undo_set_for(e, b->index, t, 1, worker, key);
        e->reshaped = slot != KM_SLOT_NONE && !km_slot_is_shared(km_table_slot(t, slot)) &&
                      km_table_set_count(t, slot) == KM_SLOT_INLINE;
        b->n_log++;
    }
    int rc;
    if (slot == KM_SLOT_NONE && vacant != KM_SLOT_NONE) { /* the insert needs no reserve */
        km_table_insert_vacant(t, key, vacant, worker);
        *inserted = 1;
        *slot_out = vacant;
        return 1;
    }
    if (slot == KM_SLOT_NONE) {
        uint64_t capacity = t->capacity;
        double start = km_table_insert_grows(t) ? monotonic_ms() : 0;
        rc = km_table_insert(t, key, 1, &slot);
        if (rc) {
            b->n_log -= b->logging;
            return rc;
        }
        if (t->capacity != capacity)
            note_growth(b->index, t, capacity, monotonic_ms() - start);
        *inserted = 1;
    }
    rc = km_table_set_add(t, slot, worker);
    if (rc < 0) {
        if (*inserted)
            km_table_erase(t, slot);
        b->n_log -= b->logging;
        return rc;
    }
    *slot_out = slot;
    return 1;
}

/* Remove worker from the set at slot of table t; erases the key when the set empties. Returns 1
 * when the key was erased. */
__attribute__((always_inline)) static inline int table_remove_at(batch *b, km_table *t,
                                                                uint64_t slot, uint32_t worker)
{
    const km_slot *s = km_table_slot(t, slot);
    if (b->logging) {
        undo_entry *e = undo_next(b);
        if (!e)
            return KM_ERR_OUT_OF_MEMORY;
        undo_set_for(e, b->index, t, 0, worker, s->key);
        e->reshaped = km_slot_is_shared(s) && km_slot_count(s) == KM_SLOT_DEMOTE_AT + 1;
        if (t->meta)
            e->u.meta = *km_table_meta(t, slot);
        b->n_log++;
    }
    return km_table_set_remove_erase(t, slot, worker);
}

/* ---- segment keys -------------------------------------------------------------------------- */

static uint32_t segment_size(const km_index *index)
{
    return index->config.segment_blocks;
}

/* The offset after a known one: block metadata keeps a block's position modulo S (0 without
 * segment keys). */
static uint32_t next_offset(uint32_t offset, uint32_t S)
{
    uint32_t next = offset + 1;
    /* (offset + 1) mod S, dividing only for an offset past the segment (a division is slow). */
    return !S ? 0 : next < S ? next : next == S ? 0 : next % S;
}

/* ---- segment fingerprints ---------------------------------------------------------------------
 * The segment table's aux bytes hold, per segment key, one byte per block of its chain: a
 * fingerprint of that block's chain hash (chain_fingerprint), or 0 where it is unknown. A worker
 * that loses block X at offset k of a segment leaves each segment key of that anchor whose byte k
 * matches X's fingerprint or is 0. A mismatch proves X is not on that key's chain; a false match
 * (about 1 in 255) drops the worker from a segment it still holds, which is sound: scoring walks
 * that segment block by block and stays exact. This replaced walking parent links from every
 * candidate segment end back to X's position (up to S-1 dependent lookups each). */
static inline uint8_t chain_fingerprint(uint64_t chain)
{
    uint8_t f = (uint8_t)(chain >> 56);
    return f ? f : 1;
}

/* Fingerprints of the S blocks ending at `end`, by walking back through their parents (0 past a
 * break: a block gone, a parent not found by its tag). */
static void fingerprints_by_walk(const km_index *index, uint64_t end, uint8_t *fps)
{
    uint32_t S = index->config.segment_blocks;
    memset(fps, 0, S);
    uint64_t slot = km_table_find(&index->blocks, end);
    for (uint32_t k = S; k-- > 0 && slot != KM_SLOT_NONE;) {
        fps[k] = chain_fingerprint(km_table_slot(&index->blocks, slot)->key);
        slot = km_table_find_parent(&index->blocks, km_table_meta(&index->blocks, slot));
    }
}

/* Add worker to the segment key `end` (first block `anchor`); `fps` are the fingerprints of its
 * S blocks, stored when the key is new. */
static int segment_add(batch *b, uint32_t anchor_tag, uint64_t end, uint32_t worker, const uint8_t *fps)
{
    km_index *index = b->index;
    uint64_t slot;
    int inserted;
    int rc = table_add(b, &index->segments, end, worker, &slot, &inserted);
    if (rc <= 0)
        return rc;
    if (!inserted)
        return KM_OK;
    memcpy(km_table_aux(&index->segments, slot), fps, index->segments.aux_bytes);
    undo_entry e = {.kind = UNDO_ANCHOR_LINKED, .key = end, .aux = anchor_tag};
    rc = undo_push(b, &e);
    if (!rc) {
        rc = anchor_link(index, anchor_tag, end, 1);
        if (rc)
            b->n_log -= b->logging;
    }
    return rc; /* on failure the caller's rollback removes the segment key logged above */
}

/* Remove worker from segment key `end`; unlink it from its anchor when the set empties. */
static int segment_remove_at(batch *b, uint64_t slot, uint32_t anchor_tag, uint32_t worker)
{
    km_index *index = b->index;
    uint64_t end = km_table_slot(&index->segments, slot)->key;
    int rc = table_remove_at(b, &index->segments, slot, worker);
    if (rc < 0)
        return rc;
    if (rc == 1) {
        undo_entry e = {.kind = UNDO_ANCHOR_UNLINKED, .key = end, .aux = anchor_tag};
        rc = undo_push(b, &e);
        if (rc)
            return rc;
        anchor_unlink(index, anchor_tag, end);
    }
    return KM_OK;
}

/* Does worker hold all S blocks of the segment ending at `end` (offset S-1)? Walks back from end
 * through each block's parent (km_table_find_parent), checking each block is held and sits one
 * offset earlier; fills fps. A parent its tag leaves ambiguous ends the walk with 0, which is
 * sound (scoring walks that segment block by block). The one way the walk can be misled: a parent
 * that is gone while another block of its segment, at its offset, carries the same 24-bit tag
 * (about 2^-24 per such sibling), held by the worker with all of its own ancestors. */
static int holds_segment(const km_index *index, uint32_t worker, uint64_t end, uint8_t *fps)
{
    uint32_t S = segment_size(index);
    uint64_t slot = km_table_find(&index->blocks, end);
    for (uint32_t k = 0; k < S; k++) {
        if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->blocks, slot, worker))
            return 0;
        const km_block_meta *m = km_table_meta(&index->blocks, slot);
        if (km_meta_offset(m) != S - 1 - k)
            return 0;
        fps[S - 1 - k] = chain_fingerprint(km_table_slot(&index->blocks, slot)->key);
        if (k + 1 < S)
            slot = km_table_find_parent(&index->blocks, m);
    }
    return 1;
}

/* ---- open segments ---------------------------------------------------------------------------- */

/* Engines store a sequence one to three blocks per step, so the run that completes a segment is
 * rarely S blocks long, and holds_segment would walk S - 1 parents (each a dependent miss) to
 * prove the worker holds the rest. Instead each worker keeps a few open segments it holds from
 * their first block on: the anchor tag, the offset and chain hash of the last block stored, and
 * the fingerprints so far. A store whose parent is an open segment's last block, one offset
 * further in the same anchor, extends it; a segment completed that way is held without a walk.
 *
 * Contract: an entry exists only while its worker holds every block it names. A remove of one of
 * the worker's blocks drops the worker's entries of that block's anchor tag (colliding tags drop
 * more: sound); clearing or removing the worker drops all of its entries; a rolled-back batch and
 * a loaded snapshot drop every entry. An entry missing or overwritten only costs the walk. */
enum { OPEN_SEGMENTS_PER_WORKER = KM_OPEN_SEGMENTS, OPEN_NONE = -1 };
_Static_assert(OPEN_SEGMENTS_PER_WORKER % 4 == 0 && OPEN_SEGMENTS_PER_WORKER <= 16,
               "a worker's entries fit the bits of `used`, their tags whole 16-byte words");

/* The worker's entries, or NULL before the first was allocated. */
static struct km_open_segments *open_of(km_index *index, uint32_t worker)
{
    return index->open_segments ? &index->open_segments[worker] : NULL;
}

static uint8_t *open_fps(km_index *index, uint32_t worker, int k)
{
    return index->open_fingerprints +
           ((size_t)worker * OPEN_SEGMENTS_PER_WORKER + (size_t)k) * segment_size(index);
}

/* Bit k set for each of the entries (in use or not) whose anchor tag is `tag`. */
static uint32_t open_tag_matches(const struct km_open_segments *os, uint32_t tag)
{
    uint32_t matches = 0;
#if defined(__SSE2__)
    const __m128i want = _mm_set1_epi32((int)tag);
#define TAGS_AT(k)                                                                                 \
    ((uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(                                 \
         _mm_loadu_si128((const __m128i *)(const void *)&os->anchor_tag[k]), want)))             \
     << (k))
    _Static_assert(OPEN_SEGMENTS_PER_WORKER == 16, "four words of four tags");
    matches = TAGS_AT(0) | TAGS_AT(4) | TAGS_AT(8) | TAGS_AT(12);
#undef TAGS_AT
#else
    for (uint32_t k = 0; k < OPEN_SEGMENTS_PER_WORKER; k++)
        matches |= (uint32_t)(os->anchor_tag[k] == tag) << k;
#endif
    return matches;
}

/* The worker's open segment whose last block is `last` at `offset` of `anchor_tag`, or
 * OPEN_NONE. */
static int open_find(km_index *index, uint32_t worker, uint64_t last, uint32_t anchor_tag,
                     uint32_t offset)
{
    const struct km_open_segments *os = open_of(index, worker);
    if (!os)
        return OPEN_NONE;
    for (uint32_t m = open_tag_matches(os, anchor_tag) & os->used; m; m &= m - 1) {
        int k = __builtin_ctz(m);
        if (os->last[k] == last && os->offset[k] == offset)
            return k;
    }
    return OPEN_NONE;
}

/* Entry k was started or extended (recent: see struct km_open_segments). Clearing recent once
 * it holds every entry in use keeps it from holding all OPEN_SEGMENTS_PER_WORKER of them. */
static void open_touch(struct km_open_segments *os, int k)
{
    os->recent |= (uint16_t)(1u << k);
    if ((os->recent & os->used) == os->used)
        os->recent = 0;
}

/* An entry for a segment the worker starts with `first` (reusing entry `reuse` when not
 * OPEN_NONE), or OPEN_NONE when the entries could not be allocated. */
static int open_start(km_index *index, uint32_t worker, int reuse, uint64_t first,
                      uint32_t anchor_tag)
{
    if (!index->open_segments) {
        size_t n = (size_t)index->config.max_workers * OPEN_SEGMENTS_PER_WORKER;
        index->open_segments = calloc(index->config.max_workers, sizeof *index->open_segments);
        index->open_fingerprints = malloc(n * segment_size(index));
        if (!index->open_segments || !index->open_fingerprints) {
            free(index->open_segments);
            free(index->open_fingerprints);
            index->open_segments = NULL;
            index->open_fingerprints = NULL;
            return OPEN_NONE;
        }
    }
    struct km_open_segments *os = &index->open_segments[worker];
    int k = reuse;
    if (k == OPEN_NONE) {
        uint32_t all = (1u << OPEN_SEGMENTS_PER_WORKER) - 1u;
        uint32_t unused = ~(uint32_t)os->used & all;
        /* The first entry not in use; when all are, the first not extended lately (a sequence
         * that stopped growing leaves its entry behind, while those still growing extend theirs
         * at nearly every step). While every entry is in use, recent lacks one of them. */
        uint32_t pick = unused ? unused : ~(uint32_t)os->recent & all;
        k = pick ? __builtin_ctz(pick) : 0;
    }
    os->last[k] = first;
    os->anchor_tag[k] = anchor_tag;
    os->offset[k] = 0;
    os->used |= (uint16_t)(1u << k);
    open_touch(os, k);
    open_fps(index, worker, k)[0] = chain_fingerprint(first);
    return k;
}

/* The worker no longer holds a block of anchor_tag's segments. */
static void open_drop_anchor(km_index *index, uint32_t worker, uint32_t anchor_tag)
{
    struct km_open_segments *os = open_of(index, worker);
    if (os)
        os->used &= (uint16_t)~open_tag_matches(os, anchor_tag);
}

static void open_drop_worker(km_index *index, uint32_t worker)
{
    struct km_open_segments *os = open_of(index, worker);
    if (os)
        os->used = 0;
}

void km_index_forget_open_segments(km_index *index)
{
    if (index->open_segments)
        memset(index->open_segments, 0,
               (size_t)index->config.max_workers * sizeof *index->open_segments);
}

/* After worker lost `block` (metadata m): drop worker from every segment key whose chain includes
 * it (or, about once in 255, one whose fingerprint only looks so: sound). */
static int invalidate_segments(batch *b, uint32_t worker, uint64_t block, const km_block_meta *m)
{
    km_index *index = b->index;
    if (segment_size(index) == 0 || km_meta_offset(m) == KM_OFFSET_UNKNOWN)
        return KM_OK;
    uint32_t anchor_tag = km_meta_anchor_tag(m);
    uint64_t *head = km_u64map_find(&index->anchors, anchor_key(anchor_tag));
    if (!head)
        return KM_OK;
    uint32_t n = (uint32_t)*head;
    while (n != ANCHOR_NONE) {
        uint64_t end = index->anchor_nodes[n].end;
        n = index->anchor_nodes[n].next; /* read before a possible unlink frees the node */
        uint64_t slot = km_table_find(&index->segments, end);
        if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->segments, slot, worker))
            continue;
        uint8_t fp = km_table_aux(&index->segments, slot)[km_meta_offset(m)];
        if (fp != 0 && fp != chain_fingerprint(block))
            continue; /* block is not on this segment's chain */
        int rc = segment_remove_at(b, slot, anchor_tag, worker);
        if (rc)
            return rc;
    }
    return KM_OK;
}

/* ---- the four update kinds ---------------------------------------------------------------------- */

/* ---- storage tiers ---------------------------------------------------------------------------- */

static int lower_tiers_empty(const km_index *index)
{
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++)
        if (index->lower[t].pairs)
            return 0;
    return 1;
}

/* The recorded tier of a pair the worker holds. */
static km_tier pair_tier(const km_index *index, uint64_t key, uint32_t worker)
{
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++) {
        const km_table *lt = &index->lower[t];
        if (!lt->pairs)
            continue;
        uint64_t slot = km_table_find(lt, key);
        if (slot != KM_SLOT_NONE && km_table_set_contains(lt, slot, worker))
            return (km_tier)(t + 1);
    }
    return KM_TIER_DEVICE;
}

/* Make the tier of a pair the worker holds (or is about to stop holding: KM_TIER_DEVICE clears
 * it from the lower tables) equal to `tier`. Returns 1 when it changed, 0 when not, <0 on error. */
static int set_pair_tier_slow(batch *b, uint64_t key, uint32_t worker, km_tier tier);

static inline int set_pair_tier(batch *b, uint64_t key, uint32_t worker, km_tier tier)
{
    if (tier == KM_TIER_DEVICE && lower_tiers_empty(b->index))
        return 0; /* the common case: every pair is device-resident */
    return set_pair_tier_slow(b, key, worker, tier);
}

static int set_pair_tier_slow(batch *b, uint64_t key, uint32_t worker, km_tier tier)
{
    km_index *index = b->index;
    km_tier current = pair_tier(index, key, worker);
    if (current == tier)
        return 0;
    if (tier != KM_TIER_DEVICE) {
        uint64_t slot;
        int inserted;
        int rc = table_add(b, &index->lower[tier - 1], key, worker, &slot, &inserted);
        if (rc < 0)
            return rc;
    }
    if (current != KM_TIER_DEVICE) {
        km_table *lt = &index->lower[current - 1];
        int rc = table_remove_at(b, lt, km_table_find(lt, key), worker);
        if (rc < 0)
            return rc;
    }
    return 1;
}

static int apply_set_tier(batch *b, const km_update *u)
{
    km_index *index = b->index;
    for (size_t i = 0; i < u->n_hashes; i++) {
        uint64_t slot = km_table_find(&index->blocks, u->hashes[i]);
        if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->blocks, slot, u->worker)) {
            b->stats->absent_tier_changes++;
            continue;
        }
        int rc = set_pair_tier(b, u->hashes[i], u->worker, u->tier);
        if (rc < 0)
            return rc;
        b->stats->tier_changes += (uint64_t)rc;
    }
    return KM_OK;
}

/* How many blocks ahead an update starts loading a block's slot and metadata (tuned with
 * `kvmatch bench replay --ceiling`: a store's misses are independent, a remove's come in a
 * dependent chain, so removes gain from starting earlier). */
enum { STORE_AHEAD = 8, REMOVE_AHEAD = 16 };

/* Engines send many small updates (one per request per step, of one to a few blocks; a remove
 * names an engine's evictions of a step), too short for the prefetches inside apply_store and
 * apply_remove to run ahead: a batch also starts the slots and metadata of the update
 * UPDATES_AHEAD places on, its blocks up to where those prefetches take over (STORE_AHEAD or
 * REMOVE_AHEAD) and a store's parent, so the misses of consecutive small updates overlap. A
 * stored block is mostly new, and the search for a new key runs to the end of its probe run,
 * which at the table's load often crosses into the next line; a remove's erase walks its block's
 * run to the end the same way (backward shift), moving the metadata of the keys it shifts: both
 * start that line too, and the metadata four slots on (in the next line when the home slot's
 * metadata ends its line). */
enum { UPDATES_AHEAD = 4 };

KM_PREFETCHER static inline void prefetch_update(const km_index *index, const km_update *u)
{
    const km_table *t = &index->blocks;
    if (u->kind != KM_UPDATE_STORE && u->kind != KM_UPDATE_REMOVE)
        return;
    if (u->kind == KM_UPDATE_STORE && u->parent != KM_NO_PARENT) {
        uint64_t home = km_slot_home(u->parent, t->capacity);
        __builtin_prefetch(&t->slots[home]);
        __builtin_prefetch(&t->meta[home]);
    }
    size_t ahead = u->kind == KM_UPDATE_STORE ? STORE_AHEAD : REMOVE_AHEAD;
    for (size_t k = 0; k < u->n_hashes && k < ahead; k++) {
        uint64_t home = km_slot_home(u->hashes[k], t->capacity);
        __builtin_prefetch(&t->slots[home], 1);
        __builtin_prefetch(&t->slots[home] + 4, 1);
        __builtin_prefetch(&t->meta[home], 1);
        __builtin_prefetch(&t->meta[home] + 4, 1);
    }
}

static int apply_store(batch *b, const km_update *u)
{
    km_index *index = b->index;
    km_worker_counters *wc = &index->workers[u->worker];
    uint32_t S = segment_size(index);
    int rc = touch_worker(b, u->worker);
    if (rc)
        return rc;

    /* Offset and segment anchor of the block before the run (unknown for an orphan run). */
    uint32_t prev_offset = KM_OFFSET_UNKNOWN;
    uint32_t prev_anchor = 0;
    int open = OPEN_NONE; /* the worker's open segment this run extends */
    if (u->parent != KM_NO_PARENT) {
        uint64_t ps = km_table_find(&index->blocks, u->parent);
        if (ps != KM_SLOT_NONE) {
            prev_offset = km_meta_offset(km_table_meta(&index->blocks, ps));
            prev_anchor = km_meta_anchor_tag(km_table_meta(&index->blocks, ps));
        }
        if (prev_offset == KM_OFFSET_UNKNOWN)
            b->stats->orphan_runs++;
        else if (S)
            open = open_find(index, u->worker, u->parent, prev_anchor, prev_offset);
    }
    uint32_t run_consecutive = 0;
    const km_table *blocks = &index->blocks;
    for (size_t i = 0; i < u->n_hashes; i++) {
        /* Most stored blocks are new: their slot and metadata are misses; start them early. */
        if (i + STORE_AHEAD < u->n_hashes) {
            uint64_t home = km_slot_home(u->hashes[i + STORE_AHEAD], blocks->capacity);
            __builtin_prefetch(&blocks->slots[home], 1);
            __builtin_prefetch(&blocks->slots[home] + 4, 1);
            __builtin_prefetch(&blocks->meta[home], 1);
        }
        uint64_t key = u->hashes[i];
        uint64_t parent = i == 0 ? u->parent : u->hashes[i - 1];
        uint32_t offset = KM_OFFSET_UNKNOWN;
        uint32_t anchor = 0;
        if (parent == KM_NO_PARENT)
            offset = 0;
        else if (prev_offset != KM_OFFSET_UNKNOWN)
            offset = next_offset(prev_offset, S);
        if (offset != KM_OFFSET_UNKNOWN)
            anchor = S && offset == 0 ? km_anchor_tag(key) : prev_anchor;

        uint64_t slot = KM_SLOT_NONE; /* set by table_add unless it fails */
        int inserted;
        int added = table_add(b, &index->blocks, key, u->worker, &slot, &inserted);
        if (added < 0)
            return added;
        km_block_meta *m = km_table_meta(&index->blocks, slot);
        if (inserted) {
            km_meta_set(m, parent, anchor, offset);
        } else if (km_meta_offset(m) == KM_OFFSET_UNKNOWN && offset != KM_OFFSET_UNKNOWN) {
            undo_entry e = {.kind = UNDO_BLOCK_META, .key = key};
            e.u.meta = *m;
            rc = undo_push(b, &e);
            if (rc)
                return rc;
            km_meta_set(m, parent, anchor, offset);
        }
        /* From here on the table's metadata is the truth (first writer wins on a disagreement). */
        if (u->tier != KM_TIER_DEVICE || !lower_tiers_empty(index)) {
            rc = set_pair_tier(b, key, u->worker, u->tier);
            if (rc < 0)
                return rc;
            b->stats->tier_changes += (uint64_t)rc;
        }
        if (added == 1) {
            b->stats->stored++;
            wc->blocks++;
            wc->stores++;
        } else {
            b->stats->duplicate_stores++;
            wc->duplicate_stores++;
        }
        /* Blocks of this run the worker now holds at consecutive offsets: S of them ending
         * here make the segment held without walking it again. */
        uint32_t m_offset = km_meta_offset(m);
        if (m_offset != KM_OFFSET_UNKNOWN &&
            (run_consecutive == 0 || m_offset == next_offset(prev_offset, S)))
            run_consecutive++;
        else
            run_consecutive = m_offset != KM_OFFSET_UNKNOWN;
        if (S && m_offset == 0) {
            open = open_start(index, u->worker, open, key, km_meta_anchor_tag(m));
        } else if (open != OPEN_NONE &&
                   m_offset == open_of(index, u->worker)->offset[open] + 1u &&
                   km_meta_anchor_tag(m) == open_of(index, u->worker)->anchor_tag[open]) {
            struct km_open_segments *os = open_of(index, u->worker); /* set while open is */
            os->last[open] = key;
            os->offset[open] = (uint8_t)m_offset;
            open_touch(os, open);
            open_fps(index, u->worker, open)[m_offset] = chain_fingerprint(key);
        } else {
            open = OPEN_NONE; /* the entry stays: the worker still holds what it names */
        }
        prev_offset = m_offset;
        prev_anchor = km_meta_anchor_tag(m);
        if (S && prev_offset == S - 1) {
            uint8_t fps[KM_MAX_SEGMENT_BLOCKS];
            int held = run_consecutive >= S;
            if (held) { /* this run's last S hashes are the segment's chain */
                for (uint32_t k = 0; k < S; k++)
                    fps[k] = chain_fingerprint(u->hashes[i + 1 - S + k]);
            } else if (open != OPEN_NONE) { /* held from its first block on, by earlier stores */
                memcpy(fps, open_fps(index, u->worker, open), S);
                held = 1;
            } else {
                held = holds_segment(index, u->worker, key, fps);
            }
            if (open != OPEN_NONE) {
                open_of(index, u->worker)->used &= (uint16_t)~(1u << open);
                open = OPEN_NONE;
            }
            rc = held ? segment_add(b, prev_anchor, key, u->worker, fps) : KM_OK;
            if (rc)
                return rc;
        }
    }
    return KM_OK;
}

/* A remove's misses come in a dependent chain per block (its slot, then its metadata, then the
 * anchor map entry the metadata names): start the first two REMOVE_AHEAD blocks ahead and the
 * third half as far ahead, so several blocks' chains overlap. */

__attribute__((always_inline)) static inline void remove_prefetch(const km_index *index,
                                                                const km_update *u, size_t i)
{
    const km_table *t = &index->blocks;
    if (i + REMOVE_AHEAD < u->n_hashes) {
        uint64_t home = km_slot_home(u->hashes[i + REMOVE_AHEAD], t->capacity);
        __builtin_prefetch(&t->slots[home]);
        __builtin_prefetch(&t->meta[home]);
    }
    if (i + REMOVE_AHEAD / 2 < u->n_hashes && index->config.segment_blocks) {
        uint64_t slot = km_table_find(t, u->hashes[i + REMOVE_AHEAD / 2]);
        if (slot != KM_SLOT_NONE && km_meta_offset(km_table_meta(t, slot)) != KM_OFFSET_UNKNOWN)
            km_u64map_prefetch(&index->anchors, anchor_key(km_meta_anchor_tag(km_table_meta(t, slot))));
    }
}

/* Take worker w out of block `key` (slot `slot`, which w holds) in every table: its open segment
 * and the segment keys through the block first (their chain walk still sees the block's
 * metadata), then its tier and the block's set. */
static int remove_pair(batch *b, uint32_t w, uint64_t key, uint64_t slot)
{
    km_index *index = b->index;
    km_block_meta meta = *km_table_meta(&index->blocks, slot);
    if (km_meta_offset(&meta) != KM_OFFSET_UNKNOWN)
        open_drop_anchor(index, w, km_meta_anchor_tag(&meta));
    int rc = invalidate_segments(b, w, key, &meta);
    if (rc)
        return rc;
    rc = set_pair_tier(b, key, w, KM_TIER_DEVICE);
    if (rc < 0)
        return rc;
    rc = table_remove_at(b, &index->blocks, slot, w);
    if (rc < 0)
        return rc;
    index->workers[w].blocks--;
    return KM_OK;
}

static int apply_remove(batch *b, const km_update *u)
{
    km_index *index = b->index;
    km_worker_counters *wc = &index->workers[u->worker];
    int rc = touch_worker(b, u->worker);
    if (rc)
        return rc;
    for (size_t i = 0; i < u->n_hashes; i++) {
        remove_prefetch(index, u, i);
        uint64_t key = u->hashes[i];
        uint64_t slot = km_table_find(&index->blocks, key);
        if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->blocks, slot, u->worker)) {
            b->stats->absent_removes++;
            wc->absent_removes++;
            continue;
        }
        rc = remove_pair(b, u->worker, key, slot);
        if (rc)
            return rc;
        b->stats->removed++;
        wc->removes++;
    }
    return KM_OK;
}

/* Slot s of a table whose growth is finished (so s indexes its slots array) holds a key that
 * worker w holds. */
static inline bool slot_held_by(const km_table *t, uint64_t s, uint32_t w)
{
    return t->slots[s].key > KM_KEY_TOMBSTONE &&
           km_slot_contains(&t->slots[s], t->pool, t->words_per_set, w);
}

/* Every pair of worker w found by scanning each table whole. */
static int clear_by_scan(batch *b, uint32_t w)
{
    km_index *index = b->index;
    int rc;
    /* The scans walk one array per table: finish any growth first (a whole-table pass either
     * way). */
    km_table_finish_growth(&index->segments);
    km_table_finish_growth(&index->blocks);
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++)
        km_table_finish_growth(&index->lower[t]);
    /* Segment keys first: unlinking needs each end block's anchor from the block metadata.
     * Each scan stays on a slot after removing w there: an erase shifts later keys of the probe run
     * back, possibly into this very slot (km_table_erase). */
    km_table *seg = &index->segments;
    for (uint64_t s = 0; s < seg->capacity;) {
        uint64_t end = seg->slots[s].key;
        if (!slot_held_by(seg, s, w)) {
            s++;
            continue;
        }
        uint64_t bs = km_table_find(&index->blocks, end);
        uint32_t anchor = bs == KM_SLOT_NONE ? 0 : km_meta_anchor_tag(km_table_meta(&index->blocks, bs));
        rc = segment_remove_at(b, s, anchor, w);
        if (rc)
            return rc;
    }
    for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++) {
        km_table *lt = &index->lower[t];
        for (uint64_t s = 0; lt->pairs && s < lt->capacity;) {
            if (!slot_held_by(lt, s, w)) {
                s++;
                continue;
            }
            rc = table_remove_at(b, lt, s, w);
            if (rc < 0)
                return rc;
        }
    }
    km_table *blk = &index->blocks;
    for (uint64_t s = 0; s < blk->capacity;) {
        if (!slot_held_by(blk, s, w)) {
            s++;
            continue;
        }
        rc = table_remove_at(b, blk, s, w);
        if (rc < 0)
            return rc;
        b->stats->cleared++;
    }
    return KM_OK;
}

static int apply_clear(batch *b, const km_update *u)
{
    km_index *index = b->index;
    uint32_t w = u->worker;
    km_worker_counters *wc = &index->workers[w];
    int rc = touch_worker(b, w);
    if (rc)
        return rc;
    open_drop_worker(index, w);
    /* The blocks the caller names first, one lookup each: with a list of everything the worker
     * holds (the event feed keeps one), nothing is left for the table scans below. */
    for (size_t i = 0; i < u->n_hashes; i++) {
        remove_prefetch(index, u, i);
        uint64_t slot = km_table_find(&index->blocks, u->hashes[i]);
        if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->blocks, slot, w))
            continue;
        rc = remove_pair(b, w, u->hashes[i], slot);
        if (rc)
            return rc;
        b->stats->cleared++;
    }
    /* A worker holding no block holds no lower-tier pair and no segment key either (both are
     * only ever kept for blocks it holds): only the rest needs the scans, which cost the whole
     * table whatever the worker holds. */
    if (wc->blocks > 0) {
        b->stats->clear_scans++;
        rc = clear_by_scan(b, w);
        if (rc)
            return rc;
    }
    if (u->kind == KM_UPDATE_REMOVE_WORKER) {
        memset(wc, 0, sizeof *wc);
    } else {
        wc->blocks = 0;
        wc->clears++;
    }
    return KM_OK;
}

/* Undo one logged mutation. Never allocates (see the file comment). */
static void undo_one(km_index *index, const undo_entry *e)
{
    switch (e->kind) {
    case UNDO_BLOCK_ADDED:
    case UNDO_SEG_ADDED:
    case UNDO_TIER_ADDED: {
        km_table *t = undo_table(index, e);
        uint64_t slot = km_table_find(t, e->key);
        if (slot == KM_SLOT_NONE)
            return;
        km_table_set_remove(t, slot, e->worker);
        if (e->reshaped)
            km_table_set_demote(t, slot);
        if (km_table_set_count(t, slot) == 0)
            km_table_erase(t, slot);
        return;
    }
    case UNDO_BLOCK_REMOVED:
    case UNDO_SEG_REMOVED:
    case UNDO_TIER_REMOVED: {
        km_table *t = undo_table(index, e);
        uint64_t slot = km_table_find(t, e->key);
        if (slot == KM_SLOT_NONE) {
            km_table_insert(t, e->key, 0, &slot);
            if (t->meta)
                *km_table_meta(t, slot) = e->u.meta;
            /* A segment key comes back after its blocks (logged later, undone earlier). */
            if (t->aux)
                fingerprints_by_walk(index, e->key, km_table_aux(t, slot));
        }
        km_table_set_add(t, slot, e->worker);
        if (e->reshaped) /* the bitmap its demotion released is free again by now */
            km_table_set_promote(t, slot);
        return;
    }
    case UNDO_BLOCK_META: {
        uint64_t slot = km_table_find(&index->blocks, e->key);
        if (slot != KM_SLOT_NONE)
            *km_table_meta(&index->blocks, slot) = e->u.meta;
        return;
    }
    case UNDO_ANCHOR_LINKED:
        anchor_unlink(index, (uint32_t)e->aux, e->key);
        return;
    case UNDO_ANCHOR_UNLINKED:
        anchor_link(index, (uint32_t)e->aux, e->key, 0);
        return;
    case UNDO_WORKER_COUNTERS:
        index->workers[e->worker] = index->undo_saved[e->aux].counters;
        return;
    }
}

static int validate_updates(km_index *index, const km_update *updates, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const km_update *u = &updates[i];
        if (u->kind < KM_UPDATE_STORE || u->kind > KM_UPDATE_SET_TIER)
            return km_index_fail(index, KM_ERR_INVALID_ARGUMENT, "update %zu: unknown kind %d", i,
                                 (int)u->kind);
        if ((u->kind == KM_UPDATE_STORE || u->kind == KM_UPDATE_SET_TIER) &&
            (unsigned)u->tier >= KM_TIER_COUNT)
            return km_index_fail(index, KM_ERR_INVALID_ARGUMENT, "update %zu: unknown tier %d", i,
                                 (int)u->tier);
        if (u->worker >= index->config.max_workers)
            return km_index_fail(index, KM_ERR_WORKER_RANGE,
                                 "update %zu: worker %u out of range (max_workers %u)", i, u->worker,
                                 index->config.max_workers);
        if (u->n_hashes > 0 && !u->hashes)
            return km_index_fail(index, KM_ERR_NULL_POINTER, "update %zu: hashes is NULL", i);
        for (size_t j = 0; j < u->n_hashes; j++)
            if (u->hashes[j] <= KM_KEY_TOMBSTONE)
                return km_index_fail(index, KM_ERR_INVALID_ARGUMENT,
                                     "update %zu: hash %zu is a reserved value (%llu); chain "
                                     "hashes are remapped (docs/HASHING.md)",
                                     i, j, (unsigned long long)u->hashes[j]);
        if (u->kind == KM_UPDATE_STORE && u->parent == KM_HASH_RESERVED_TOMBSTONE)
            return km_index_fail(index, KM_ERR_INVALID_ARGUMENT, "update %zu: parent is reserved", i);
    }
    return KM_OK;
}

/* One batch's share of the moves while a replica waits: up to replica_growth_step old slots of each
 * growing table, in chunks of 512, ending early once replica_growth_budget_ms have passed since
 * `start` (the first steps into fresh arrays pay a page fault for most keys they move), but never
 * before one chunk per table, so every move progresses. Returns 1 while a table is still growing. */
static int advance_growths(km_index *index, double start)
{
    km_table *tables[2] = {&index->blocks, &index->segments};
    int growing = 0;
    for (int k = 0; k < 2; k++) {
        uint64_t left = index->replica_growth_step;
        while (tables[k]->old_slots && left > 0) {
            uint64_t n = left < 512 ? left : 512;
            km_table_advance_growth(tables[k], n);
            left -= n;
            if (index->replica_growth_budget_ms > 0 &&
                monotonic_ms() - start >= index->replica_growth_budget_ms)
                break;
        }
        growing |= tables[k]->old_slots != NULL;
    }
    return growing;
}

/* A device replica mirrors one array per table, so it cannot follow a table whose keys are moving
 * between two. While a move lasts the replica is left as it was and marked stale, batches are
 * scored on the host (km_index_match_batch), and each batch moves a bounded step more
 * (advance_growths); the first sync after the move ends uploads the tables whole (the growth set
 * layout_changed, which also stopped dirty-slot tracking meanwhile). Only when no host scorer can
 * be had does the move end here at once, a pause as long as rehashing the table. */
static void sync_backend(km_index *index)
{
    if (!index->backend->sync)
        return;
    if (index->blocks.old_slots || index->segments.old_slots) {
        double start = monotonic_ms();
        int growing = advance_growths(index, start);
        char why[256] = "";
        if (growing && !have_host_scorer(index, why, sizeof why))
            km_index_log(index, KM_LOG_WARNING
                         "no host scorer while a table grows (%s): the move ends now", why);
        if (growing && !index->host_scorer) {
            km_table_finish_growth(&index->blocks);
            km_table_finish_growth(&index->segments);
            growing = 0;
        }
        note_growth_pause(index, monotonic_ms() - start);
        if (growing) {
            index->replica_stale = 1;
            return;
        }
    }
    index->replica_stale = 0;
    int rc = index->backend->sync(index->backend_state, index);
    char why[256] = "";
    if (rc == KM_ERR_OUT_OF_MEMORY && have_host_scorer(index, why, sizeof why)) {
        /* Device or staging memory ran out: the replica is behind, the host tables are right.
         * Batches are scored on the host until a later sync succeeds; the dirty lists stay for it
         * (they give way to a whole upload once as long as the table: host_table.c). The batch
         * itself has succeeded: its updates are in the host tables. */
        index->replica_stale = 1;
        km_index_log(index, KM_LOG_WARNING
                     "backend %s: sync failed with %s: scoring on the host until one succeeds",
                     index->backend->name, km_error_name(rc));
        return;
    }
    if (rc) {
        /* Any other failure (a CUDA error, a broken invariant), or out of memory with no host
         * scorer: the replica cannot be trusted, and the CPU backend takes over for good. When
         * even that cannot be made, backend_failed keeps the replica from scoring until it can. */
        char detail[sizeof index->last_error];
        snprintf(detail, sizeof detail, "%s", index->last_error);
        if (fall_back_to_cpu(index, rc, "sync") != KM_OK) {
            index->backend_failed = rc;
            snprintf(index->backend_failed_detail, sizeof index->backend_failed_detail, "%s",
                     detail);
        }
        return;
    }
    index->backend_failed = 0;
    km_table_clear_dirty(&index->blocks);
    km_table_clear_dirty(&index->segments);
    return;
}

int km_index_apply(km_index *index, const km_update *updates, size_t n_updates,
                   km_update_stats *stats_out)
{
    if (!index)
        return KM_ERR_NULL_POINTER;
    index->last_error[0] = '\0';
    if (!updates && n_updates > 0)
        return km_index_fail(index, KM_ERR_NULL_POINTER, "updates is NULL");
    int rc = validate_updates(index, updates, n_updates);
    if (rc)
        return rc;

    km_update_stats stats = {0};
    batch b = {.index = index, .stats = &stats};
    /* Only stores and tier changes allocate; a batch without them cannot fail half way and needs
     * no log. */
    for (size_t i = 0; i < n_updates && !b.logging; i++)
        b.logging = (updates[i].kind == KM_UPDATE_STORE || updates[i].kind == KM_UPDATE_SET_TIER) &&
                    updates[i].n_hashes > 0;
    if (b.logging && !index->undo_touched) {
        index->undo_touched = calloc(index->config.max_workers, 1);
        if (!index->undo_touched)
            return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "undo bookkeeping");
    }
    for (size_t i = 0; i < n_updates && !rc; i++) {
        const km_update *u = &updates[i];
        if (i + UPDATES_AHEAD < n_updates)
            prefetch_update(index, &updates[i + UPDATES_AHEAD]);
        if (i + 2 * UPDATES_AHEAD < n_updates && updates[i + 2 * UPDATES_AHEAD].n_hashes)
            __builtin_prefetch(updates[i + 2 * UPDATES_AHEAD].hashes);
        switch (u->kind) {
        case KM_UPDATE_STORE:
            rc = apply_store(&b, u);
            break;
        case KM_UPDATE_REMOVE:
            rc = apply_remove(&b, u);
            break;
        case KM_UPDATE_CLEAR_WORKER:
        case KM_UPDATE_REMOVE_WORKER:
            rc = apply_clear(&b, u);
            break;
        case KM_UPDATE_SET_TIER:
            rc = apply_set_tier(&b, u);
            break;
        }
        if (rc)
            km_index_fail(index, rc, "update %zu (worker %u): %s; batch rolled back", i, u->worker,
                          rc == KM_ERR_MEMORY_CAP ? "memory cap reached" : km_strerror(rc));
    }
    if (rc) {
        for (size_t i = b.n_log; i-- > 0;)
            undo_one(index, &index->undo_log[i]);
        km_index_forget_open_segments(index);
    }
    for (size_t i = 0; i < b.n_saved; i++)
        index->undo_touched[index->undo_saved[i].worker] = 0;
    if (b.logging && index->undo_capacity > UNDO_KEEP_ENTRIES && b.n_log < index->undo_capacity / 4) {
        free(index->undo_log);
        index->undo_log = NULL;
        index->undo_capacity = 0;
    }
    sync_backend(index); /* never fails the batch: a replica behind is scored around */
    if (rc)
        return rc;
    if (stats_out)
        *stats_out = stats;
    return KM_OK;
}

int km_index_store(km_index *index, uint32_t worker, uint64_t parent, const uint64_t *hashes,
                   size_t n_hashes)
{
    km_update u = {KM_UPDATE_STORE, worker, parent, hashes, n_hashes, KM_TIER_DEVICE};
    return km_index_apply(index, &u, 1, NULL);
}

int km_index_remove(km_index *index, uint32_t worker, const uint64_t *hashes, size_t n_hashes)
{
    km_update u = {KM_UPDATE_REMOVE, worker, KM_NO_PARENT, hashes, n_hashes, KM_TIER_DEVICE};
    return km_index_apply(index, &u, 1, NULL);
}

int km_index_clear_worker(km_index *index, uint32_t worker)
{
    km_update u = {KM_UPDATE_CLEAR_WORKER, worker, KM_NO_PARENT, NULL, 0, KM_TIER_DEVICE};
    return km_index_apply(index, &u, 1, NULL);
}

int km_index_remove_worker(km_index *index, uint32_t worker)
{
    km_update u = {KM_UPDATE_REMOVE_WORKER, worker, KM_NO_PARENT, NULL, 0, KM_TIER_DEVICE};
    return km_index_apply(index, &u, 1, NULL);
}

/* ---- snapshots support (src/index/snapshot.c) ------------------------------------------------------- */

int km_index_rebuild_anchors(km_index *index)
{
    km_table_finish_growth(&index->segments); /* the scan walks one array */
    const km_table *seg = &index->segments;
    for (uint64_t s = 0; s < seg->capacity; s++) {
        uint64_t end = seg->slots[s].key;
        if (end <= KM_KEY_TOMBSTONE)
            continue;
        uint64_t bs = km_table_find(&index->blocks, end);
        if (bs == KM_SLOT_NONE ||
            km_meta_offset(km_table_meta(&index->blocks, bs)) == KM_OFFSET_UNKNOWN)
            return KM_ERR_CORRUPT;
        int rc = anchor_link(index, km_meta_anchor_tag(km_table_meta(&index->blocks, bs)), end, 1);
        if (rc)
            return rc;
    }
    return KM_OK;
}

void km_index_tables_replaced(km_index *index)
{
    set_dirty_tracking(index);
    index->blocks.layout_changed = 1;
    index->segments.layout_changed = 1;
    sync_backend(index);
}

/* ---- scoring ------------------------------------------------------------------------------ */

void km_match_results_init(km_match_results *r)
{
    memset(r, 0, sizeof *r);
}

void km_match_results_free(km_match_results *r)
{
    if (!r)
        return;
    free(r->requests);
    free(r->matches);
    free(r->tiers);
    memset(r, 0, sizeof *r);
}

/* Buffers are allocated on first use even for 0 entries: callers index them as `matches + first`
 * for every request, and pointer arithmetic on NULL is undefined even with an offset of 0. */
int km_match_results_reserve(km_match_results *r, size_t n_requests, size_t n_matches)
{
    if (KM_ARRAY_GROW(r->requests, r->requests_capacity, n_requests, 64))
        return KM_ERR_OUT_OF_MEMORY;
    /* At least one entry, so that matches is never NULL. */
    if (KM_ARRAY_GROW(r->matches, r->matches_capacity, n_matches ? n_matches : 1, 256))
        return KM_ERR_OUT_OF_MEMORY;
    return KM_OK;
}

/* Split each worker's matched prefix by tier: for block i of a request, every worker listed in a
 * lower tier table whose depth exceeds i holds block i in that tier. Probes only blocks below the
 * request's deepest match, and nothing at all while every pair is device-resident: then only the
 * entries past results->tiers_zeroed are cleared, so a reused results costs nothing per batch
 * (at 1,024 workers a batch has about a million entries). Growing keeps tiers_zeroed valid:
 * reallocation preserves the leading entries. */
static int split_tiers(km_index *index, const km_request *requests, size_t n_requests,
                       km_match_results *results)
{
    size_t need = results->n_matches ? results->n_matches : 1; /* never NULL after */
    if (KM_ARRAY_GROW(results->tiers, results->tiers_capacity, need, 256))
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "tier split for %zu matches",
                             results->n_matches);
    if (results->tiers_zeroed < results->n_matches) {
        memset(results->tiers + results->tiers_zeroed, 0,
               (results->n_matches - results->tiers_zeroed) * sizeof *results->tiers);
        results->tiers_zeroed = results->n_matches;
    }
    if (lower_tiers_empty(index))
        return KM_OK;
    results->tiers_zeroed = 0; /* the split below writes counts into some entries */
    uint32_t *holders = malloc(index->config.max_workers * sizeof *holders);
    if (!holders)
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "tier split scratch");
    for (size_t q = 0; q < n_requests; q++) {
        const km_request_result *rr = &results->requests[q];
        const km_worker_match *m = results->matches + rr->first;
        km_match_tiers *tiers = results->tiers + rr->first;
        for (uint32_t i = 0; i < rr->owner_depth; i++) {
            for (uint32_t t = 0; t + 1 < KM_TIER_COUNT; t++) {
                const km_table *lt = &index->lower[t];
                if (!lt->pairs)
                    continue;
                uint64_t slot = km_table_find(lt, requests[q].hashes[i]);
                if (slot == KM_SLOT_NONE)
                    continue;
                uint32_t n = km_table_set_list(lt, slot, holders, index->config.max_workers);
                /* Both lists ascend by worker: merge. */
                uint32_t j = 0;
                for (uint32_t h = 0; h < n; h++) {
                    while (j < rr->count && m[j].worker < holders[h])
                        j++;
                    if (j == rr->count)
                        break;
                    if (m[j].worker == holders[h] && i < m[j].depth) {
                        if (t == KM_TIER_HOST - 1)
                            tiers[j].host_blocks++;
                        else
                            tiers[j].disk_blocks++;
                    }
                }
            }
        }
    }
    free(holders);
    return KM_OK;
}

int km_index_match_batch(km_index *index, const km_request *requests, size_t n_requests,
                         km_match_results *results)
{
    if (!index)
        return KM_ERR_NULL_POINTER;
    index->last_error[0] = '\0';
    if (!results)
        return km_index_fail(index, KM_ERR_NULL_POINTER, "results is NULL");
    /* Empty from here on, so a refused batch leaves no earlier batch's scores to be taken for its
     * own. */
    results->n_requests = 0;
    results->n_matches = 0;
    results->probes = 0;
    if (!requests && n_requests > 0)
        return km_index_fail(index, KM_ERR_NULL_POINTER, "requests is NULL");
    for (size_t i = 0; i < n_requests; i++) {
        if (requests[i].n_hashes > index->config.max_request_blocks)
            return km_index_fail(index, KM_ERR_TOO_LARGE,
                                 "request %zu has %u blocks; max_request_blocks is %u", i,
                                 requests[i].n_hashes, index->config.max_request_blocks);
        if (requests[i].n_hashes > 0 && !requests[i].hashes)
            return km_index_fail(index, KM_ERR_NULL_POINTER, "request %zu: hashes is NULL", i);
    }
    if (km_match_results_reserve(results, n_requests, 0))
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "results for %zu requests", n_requests);
    if (n_requests == 0)
        return KM_OK;
    int rc, device_rc = KM_OK;
    if (index->replica_stale) { /* a table is growing, or a sync ran out of memory: the host tables
                                 * are the current ones */
        index->host_scored_batches++;
        rc = km_backend_cpu.match(index->host_scorer, index, requests, n_requests, results);
    } else if (index->backend_failed) { /* a sync failed and no CPU backend could be made then */
        rc = device_rc = km_index_fail(index, index->backend_failed, "%s",
                                       index->backend_failed_detail);
    } else {
        rc = index->backend->match(index->backend_state, index, requests, n_requests, results);
        if (index->backend != &km_backend_cpu)
            device_rc = rc;
    }
    char why[256] = "";
    if (device_rc == KM_ERR_OUT_OF_MEMORY && !index->backend_failed &&
        have_host_scorer(index, why, sizeof why)) {
        /* The replica's scoring ran out of device or staging memory: the host tables are current,
         * so this batch is scored there; the replica stays for the next. */
        km_index_log(index, KM_LOG_WARNING
                     "backend %s: scoring failed with %s: this batch scored on the host",
                     index->backend->name, km_error_name(rc));
        index->last_error[0] = '\0';
        results->n_matches = 0;
        results->probes = 0;
        index->host_scored_batches++;
        rc = km_backend_cpu.match(index->host_scorer, index, requests, n_requests, results);
    } else if (device_rc) {
        /* Any other failure of the replica (a CUDA error, a broken invariant such as an entry
         * count past max_workers), or of a sync before it: the CPU backend takes over for good
         * and scores the batch. */
        const char *what = index->backend_failed ? "sync" : "match";
        results->n_matches = 0;
        results->probes = 0;
        rc = fall_back_to_cpu(index, device_rc, what);
        if (rc == KM_OK)
            rc = index->backend->match(index->backend_state, index, requests, n_requests, results);
    }
    if (rc) {
        results->n_requests = 0; /* a failed backend may have filled some: none is valid */
        results->n_matches = 0;
        results->probes = 0;
        return index->last_error[0] ? rc : km_index_fail(index, rc, "scoring failed");
    }
    results->n_requests = n_requests;
    if (index->window_rule_workers)
        km_window_rules_apply(index, requests, n_requests, results);
    rc = split_tiers(index, requests, n_requests, results);
    if (rc)
        results->n_requests = 0;
    return rc;
}

/* ---- inspection --------------------------------------------------------------------------- */

uint32_t km_index_max_workers(const km_index *index)
{
    return index ? index->config.max_workers : 0;
}

int km_index_worker_stats(const km_index *index, uint32_t worker, km_worker_stats *out)
{
    if (!index || !out)
        return KM_ERR_NULL_POINTER;
    if (worker >= index->config.max_workers)
        return KM_ERR_WORKER_RANGE;
    *out = index->workers[worker];
    return KM_OK;
}

int km_index_get_stats(const km_index *index, km_index_stats *out)
{
    if (!index || !out)
        return KM_ERR_NULL_POINTER;
    memset(out, 0, sizeof *out);
    out->blocks = index->blocks.live;
    out->pairs = index->blocks.pairs;
    out->segment_keys = index->segments.live;
    out->segment_pairs = index->segments.pairs;
    out->shared_sets = index->blocks.shared_sets;
    out->host_pairs = index->lower[KM_TIER_HOST - 1].pairs;
    out->disk_pairs = index->lower[KM_TIER_DISK - 1].pairs;
    out->block_capacity = index->blocks.capacity;
    out->table_growths = index->table_growths;
    out->table_growth_ms_max = index->table_growth_ms_max;
    out->table_growth_ms_total = index->table_growth_ms_total;
    out->host_scored_batches = index->host_scored_batches;
    out->memory_bytes = index->memory.used;
    out->memory_cap_bytes = index->memory.cap;
    return KM_OK;
}

int km_index_holders(const km_index *index, uint64_t hash, uint32_t *workers, uint32_t capacity,
                     uint32_t *n_out)
{
    if (!index || !n_out || (!workers && capacity > 0))
        return KM_ERR_NULL_POINTER;
    uint64_t slot = hash <= KM_KEY_TOMBSTONE ? KM_SLOT_NONE : km_table_find(&index->blocks, hash);
    *n_out = slot == KM_SLOT_NONE ? 0 : km_table_set_list(&index->blocks, slot, workers, capacity);
    return KM_OK;
}

int km_index_pair_tier(const km_index *index, uint64_t hash, uint32_t worker, km_tier *tier)
{
    if (!index || !tier)
        return KM_ERR_NULL_POINTER;
    if (worker >= index->config.max_workers)
        return KM_ERR_WORKER_RANGE;
    uint64_t slot = hash <= KM_KEY_TOMBSTONE ? KM_SLOT_NONE : km_table_find(&index->blocks, hash);
    if (slot == KM_SLOT_NONE || !km_table_set_contains(&index->blocks, slot, worker))
        return KM_ERR_NOT_FOUND;
    *tier = pair_tier(index, hash, worker);
    return KM_OK;
}
