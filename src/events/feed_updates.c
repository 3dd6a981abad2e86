/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed's index updates (include/kvmatch/feed.h, docs/EVENTS.md "The feed"): a
 * message's events become updates in the feed's queue (engine hashes to chain hashes through the
 * worker's engine-hash map, tier changes from the media a block is held in), one group per
 * message, and km_feed_flush applies the whole queue as one index batch (message by message when
 * the index refuses it). The stream's state machine, which decides what is applied, is feed.c.
 *
 * Invariants:
 *  - a message is applied only after its updates have room in the queue and its new map entries
 *    have room in the map, so applying never fails half-way.
 *  - a map entry's chain is set by the first store of its engine hash and kept until the entry is
 *    erased; the index holds exactly the chains of the entries that count (entry_counts), one per
 *    entry (apply_stored). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/hash.h"
#include "events/engine_hash_map.h"
#include "events/feed_internal.h"
#include "events/feed_flush_internal.h"

#define EMAP_PREFETCH_AHEAD 8u /* blocks: apply_stored loads map slots this far ahead */
#define MESSAGE_PREFETCH_KEYS 32u /* map slots a message starts loading before its first event */

/* ---- engine-hash map ------------------------------------------------------------------------- */

/* Engine hashes map to their chain hash and media in a km_emap (src/events/engine_hash_map.h), one
 * per worker. chain == CHAIN_UNHASHABLE marks an engine hash whose block could not be hashed
 * (extra keys kvmatch cannot read); its descendants inherit the mark. 0 is never a chain hash
 * (HASHING.md). */
#define CHAIN_UNHASHABLE UINT64_C(0)

/* ---- KV-cache groups ------------------------------------------------------------------------- */

/* A hybrid model's engine keeps each KV-cache group's blocks apart (vLLM: full attention, sliding
 * window, Mamba; one engine hash names the block in every group) and hits a prefix only as far as
 * every group can serve it: all of the prefix's full-attention blocks, the window's blocks before
 * its end, a Mamba state exactly at its end (HybridKVCacheCoordinator.find_longest_cache_hit).
 *
 * Window groups (kind "sliding_window" with a window, or "mamba", a window of one block, while
 * the engine has another group too, at most KM_MAX_WINDOW_GROUPS of them) are modelled exactly: a
 * block's chain hash counts while every other group holds it, each window group's holding is kept
 * in the index as the block's window key (km_hash_window_key), and the index scores the worker
 * under the window rule the flush gives it (km_index_set_worker_windows), which is vLLM's. Every
 * other group is required: a block counts only while all of them hold it on the GPU, so any
 * prefix of counted blocks is one those groups can serve to its end and the prediction never
 * exceeds the engine's hit. A copy in another medium (offloaded by a KV connector) counts as the
 * whole block, window keys included. With one group this is the plain rule: a block counts while
 * held. */
#define GROUP_BITS_TRACKED 31u
#define GROUP_BIT_UNTRACKED (1u << GROUP_BITS_TRACKED)
#define MEDIUM_BIT_GPU (1u << KM_KV_MEDIUM_GPU)

/* An event's group bit; groups from 31 up share one bit no block gets (never counted). */
static uint32_t group_bit(const km_kv_event *e)
{
    uint32_t g = e->has_group_idx ? e->group_idx : 0;
    return g < GROUP_BITS_TRACKED ? 1u << g : GROUP_BIT_UNTRACKED;
}

/* The blocks a group needs before a hit's end, from its store's spec, or 0 for a group that is
 * not a window group: a sliding window of W tokens needs max(1, ceil((W - 1) / block_size))
 * (vLLM's SlidingWindowManager); a Mamba group needs its state at the hit's end, which is a window
 * of one block (MambaManager: the last cached block at or before the end). */
static uint32_t window_blocks_of(const km_kv_event *e, uint32_t block_size)
{
    if (!e->kv_cache_spec_kind)
        return 0;
    if (!strcmp(e->kv_cache_spec_kind, "mamba"))
        return 1;
    if (strcmp(e->kv_cache_spec_kind, "sliding_window") || !e->has_kv_cache_spec_sliding_window ||
        e->kv_cache_spec_sliding_window < 1)
        return 0;
    uint64_t window = (uint64_t)e->kv_cache_spec_sliding_window;
    uint64_t blocks = (window - 1 + block_size - 1) / block_size;
    return blocks < 1 ? 1 : blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)blocks;
}

/* The window groups in effect for w (none while the engine has no other group). */
static uint32_t window_mask_of(uint32_t gpu_groups, uint32_t window_groups)
{
    uint32_t windows = window_groups & gpu_groups;
    if (!windows || !(gpu_groups & ~windows) ||
        (uint32_t)__builtin_popcount(windows) > KM_MAX_WINDOW_GROUPS)
        return 0;
    return windows;
}

static uint32_t window_mask(const worker *w)
{
    return window_mask_of(w->gpu_groups, w->window_groups);
}

/* The groups a block's chain hash needs: all but the window groups in effect. */
static uint32_t required_groups(const worker *w)
{
    return w->gpu_groups & ~window_mask(w);
}

/* Copies. An engine may cache a block a second time in the same group while the first copy is
 * still cached (vLLM recomputes the blocks a request's hit leaves out: the prompt's last full
 * block, a hybrid model's full-attention blocks past the hybrid hit; BlockPool keeps both) and
 * removes each copy with its own BlockRemoved of the same engine hash. The entry counts a group's
 * GPU copies beyond the first, so a removal takes the block out of the group only with its last
 * copy. Groups from KM_EMAP_COPY_GROUPS up, and copies beyond KM_EMAP_MAX_EXTRA_COPIES, are not
 * counted: their block leaves the group with the first removal, less than the engine holds, never
 * more. Other media count announcements instead ("Announcements" below). */

/* A GPU store of the entry's block in the group of gbit: true when the group held it already, a
 * copy, now counted. */
static bool gain_copy(km_emap_entry *m, uint32_t gbit)
{
    if (!(m->media & MEDIUM_BIT_GPU) || !(m->gpu_groups & gbit))
        return false;
    uint32_t g = (uint32_t)__builtin_ctz(gbit);
    if (g < KM_EMAP_COPY_GROUPS && m->extra_copies[g] < KM_EMAP_MAX_EXTRA_COPIES)
        m->extra_copies[g]++;
    return true;
}

/* A GPU removal from the group of gbit: true when another copy stays there (one fewer counted). */
static bool drop_copy(km_emap_entry *m, uint32_t gbit)
{
    uint32_t g = (uint32_t)__builtin_ctz(gbit);
    if (g >= KM_EMAP_COPY_GROUPS || !(m->gpu_groups & gbit) || !m->extra_copies[g])
        return false;
    m->extra_copies[g]--;
    return true;
}

/* Announcements. An engine may hold a block in a medium other than the GPU inside several units
 * of its own at once, announcing it once per unit stored and removing it once per unit evicted
 * (vLLM's OffloadingConnector: CPU chunks keyed by their last block; prompts that share a chunk's
 * first blocks but not its last store two chunks holding those blocks). The map counts each such
 * medium's announcements (the media bit says one; the map's side counts say more) and the block
 * leaves the medium with the last removal. A store beyond KM_EMAP_MAX_HOLDS, or one the side map
 * has no memory for, is not counted: the block then leaves the medium before the engine lets it
 * go, never after. A clear or an engine restart empties the map, counts included; a
 * replayed message is applied once (feed.c delivers each seq once), so it never counts twice. */

static unsigned medium_index(km_kv_medium m);

/* A store of the entry's block in a medium other than the GPU. */
static void gain_hold(worker *w, km_emap_entry *m, km_kv_medium medium)
{
    km_emap_gain_hold(&w->map, m, medium_index(medium));
}

/* A removal from a medium other than the GPU: true when another announcement keeps the block
 * there (one fewer counted; media unchanged); false when the block leaves the medium, which the
 * caller then does with leave_medium. */
static bool drop_hold(worker *w, const km_emap_entry *m, km_kv_medium medium)
{
    return km_emap_drop_hold(&w->map, m, medium_index(medium));
}

static void leave_medium(worker *w, km_emap_entry *m, km_kv_medium medium)
{
    km_emap_leave(&w->map, m, medium_index(medium));
}

/* The window groups (of `windows`) whose window key for the entry is in the index. */
static uint32_t entry_windows(const km_emap_entry *m, uint32_t windows)
{
    if (m->chain == CHAIN_UNHASHABLE || !m->media)
        return 0;
    return (m->media & ~MEDIUM_BIT_GPU) ? windows : (m->gpu_groups & windows);
}

/* Write the window keys of `chain` for the groups in `groups` at out; returns how many. */
static uint32_t window_keys(uint64_t *out, uint64_t chain, uint32_t groups)
{
    uint32_t n = 0;
    for (; groups; groups &= groups - 1)
        out[n++] = km_hash_window_key(chain, (uint32_t)__builtin_ctz(groups));
    return n;
}

/* Does a held, hashable entry count (is its chain in the index) under the groups `groups`? */
static bool entry_counts(const km_emap_entry *m, uint32_t groups)
{
    return m->chain != CHAIN_UNHASHABLE &&
           ((m->media & ~MEDIUM_BIT_GPU) ||
            (m->media && (m->gpu_groups & groups) == groups));
}

/* ---- queue ----------------------------------------------------------------------------------- */

static int tier_scratch_reserve(km_feed *feed, size_t n)
{
    if (n <= feed->tier_scratch_capacity)
        return KM_OK;
    uint8_t *t = realloc(feed->tier_scratch, n);
    if (!t)
        return KM_ERR_OUT_OF_MEMORY;
    feed->tier_scratch = t;
    uint64_t *c = realloc(feed->tier_chains, n * sizeof *c);
    if (!c)
        return KM_ERR_OUT_OF_MEMORY;
    feed->tier_chains = c;
    feed->tier_scratch_capacity = n;
    return KM_OK;
}

/* Room for one group of up to n_updates updates and n_hashes hashes. */
static int queue_reserve(km_feed *feed, size_t n_updates, size_t n_hashes)
{
    int rc = GROW(feed->queue, feed->queue_capacity, feed->queue_count + n_updates);
    if (!rc)
        rc = GROW(feed->groups, feed->group_capacity, feed->group_count + 1);
    if (!rc)
        rc = GROW(feed->hashes, feed->hash_capacity, feed->hash_count + n_hashes);
    if (!rc)
        feed->hash_reserved = feed->hash_count + n_hashes;
    return rc;
}

static void group_begin(km_feed *feed, const worker *w)
{
    queued_group *g = &feed->groups[feed->group_count];
    g->worker = w->id;
    g->generation = w->generation;
    g->first = feed->queue_count;
    g->count = 0;
    g->events = 0;
    g->first_key = feed->new_key_count;
    g->n_keys = 0;
    feed->group_open = true;
}

/* Close the open group; false when it queued no update (nothing for the index to refuse, so the
 * map entries it added need no record for undoing one: they are forgotten, and a stream whose
 * messages never reach the index, all unhashable, keeps no record at all). */
static bool group_end(km_feed *feed)
{
    queued_group *g = &feed->groups[feed->group_count];
    g->count = feed->queue_count - g->first;
    g->n_keys = feed->new_key_count - g->first_key;
    feed->group_open = false;
    if (g->count)
        feed->group_count++;
    else
        feed->new_key_count = g->first_key;
    return g->count != 0;
}

/* Queue one update; room was reserved. hashes (count of them) are already at feed->hashes +
 * offset. */
static void queue_push(km_feed *feed, km_update_kind kind, uint32_t id, uint64_t parent,
                       uint64_t offset, uint64_t count)
{
    queued_update *u = &feed->queue[feed->queue_count++];
    u->kind = kind;
    u->worker = id;
    u->parent = parent;
    u->offset = offset;
    u->count = count;
    u->tier = KM_TIER_DEVICE;
}

/* The best (fastest) tier among the media in a mask: GPU, then CPU (host), then disk for DISK,
 * EXTERNAL and unknown media. */
static km_tier best_tier(uint8_t media)
{
    if (media & (1u << KM_KV_MEDIUM_GPU))
        return KM_TIER_DEVICE;
    if (media & (1u << KM_KV_MEDIUM_CPU))
        return KM_TIER_HOST;
    return KM_TIER_DISK;
}

/* Queue SET_TIER updates for the chains at feed->hashes[first .. first + n) whose wanted tier
 * (tiers[i]) differs from `already`: one update per tier, hashes regrouped in place after the
 * current end of the hash queue (room reserved by the caller: n more hashes, KM_TIER_COUNT more
 * updates). */
static void queue_tier_fixes(km_feed *feed, uint32_t worker_id, const uint64_t *chains,
                             const uint8_t *tiers, uint32_t n, km_tier already)
{
    for (uint32_t t = 0; t < KM_TIER_COUNT; t++) {
        if (t == (uint32_t)already)
            continue;
        uint64_t offset = feed->hash_count, count = 0;
        for (uint32_t i = 0; i < n; i++)
            if (tiers[i] == t)
                feed->hashes[offset + count++] = chains[i];
        if (!count)
            continue;
        feed->hash_count += count;
        queue_push(feed, KM_UPDATE_SET_TIER, worker_id, KM_NO_PARENT, offset, count);
        feed->queue[feed->queue_count - 1].tier = t;
    }
}

/* Append to the hash queue the index keys the worker's map says the index holds for it (counted
 * chain hashes and window keys): a clear naming them lets the index take out exactly those, one
 * lookup each, instead of scanning its tables whole (KM_UPDATE_CLEAR_WORKER). Returns how many were
 * appended: none when they would take more than half of the queue's bound (messages keep the rest)
 * or memory is short; the clear is as exact either way, only slower. */
static uint64_t queue_held_keys(km_feed *feed, const worker *w)
{
    uint32_t windows = window_mask(w), required = required_groups(w);
    uint64_t most = km_emap_live(&w->map) * (1 + (uint64_t)__builtin_popcount(windows));
    /* The room the message's later events were promised stays theirs. */
    size_t reserved =
        feed->hash_reserved > feed->hash_count ? feed->hash_reserved : feed->hash_count;
    if (most == 0 || feed->hash_count + most > feed->config.max_queued_hashes / 2 ||
        GROW(feed->hashes, feed->hash_capacity, reserved + most))
        return 0;
    uint64_t offset = feed->hash_count, count = 0, cursor = 0;
    for (const km_emap_entry *m; (m = km_emap_next(&w->map, &cursor));) {
        if (entry_counts(m, required))
            feed->hashes[offset + count++] = m->chain;
        count += window_keys(feed->hashes + offset + count, m->chain, entry_windows(m, windows));
    }
    feed->hash_count += count;
    feed->hash_reserved = reserved + count;
    return count;
}

/* A clear or a worker's removal, naming the keys the worker's map holds (queue_held_keys). Room
 * for the update was reserved; the map must not be emptied before this. */
static void queue_clear(km_feed *feed, const worker *w, km_update_kind kind)
{
    uint64_t offset = feed->hash_count;
    uint64_t count = queue_held_keys(feed, w);
    queue_push(feed, kind, w->id, KM_NO_PARENT, offset, count);
}

/* A control update (clear / remove worker) as a group of its own, naming the keys the worker's map
 * holds (call it before emptying the map). Such updates never allocate in the index; if even this
 * queue push cannot get memory, the worker is left as it is and the error returned. */
int km_feed_queue_control(km_feed *feed, const worker *w, km_update_kind kind)
{
    int rc = queue_reserve(feed, 1, 0);
    if (rc)
        return rc;
    group_begin(feed, w);
    queue_clear(feed, w, kind);
    group_end(feed);
    return KM_OK;
}

void km_feed_pending(const km_feed *feed, uint64_t *updates, uint64_t *hashes)
{
    if (updates)
        *updates = feed ? feed->queue_count : 0;
    if (hashes)
        *hashes = feed ? feed->hash_count : 0;
}

/* ---- applying one message's events ----------------------------------------------------------- */

static uint8_t medium_bit(km_kv_medium m)
{
    return (uint8_t)(1u << ((unsigned)m < MEDIUM_COUNT ? (unsigned)m : KM_KV_MEDIUM_OTHER));
}

static unsigned medium_index(km_kv_medium m)
{
    return (unsigned)m < MEDIUM_COUNT ? (unsigned)m : KM_KV_MEDIUM_OTHER;
}

/* A medium string no tier is known for is applied at the slowest tier, and counted. */
static void count_unknown_medium(worker *w, const km_kv_event *e)
{
    if (e->medium != KM_KV_MEDIUM_OTHER)
        return;
    char example[96];
    snprintf(example, sizeof example, "%s with medium \"%s\"", km_kv_event_kind_name(e->kind),
             e->medium_name ? e->medium_name : "?");
    km_feed_count_refusal(w, KM_FEED_REFUSED_UNKNOWN_MEDIUM, 1, example);
}

/* Does a block of this event carry extra keys kvmatch cannot reproduce (the decoder's opaque flags;
 * for a caller that gives only presence flags: any present entry on an event without a LoRA
 * name)? Only KM_FEED_EXTRA_KEYS_SKIP asks. */
static bool block_is_opaque(const km_feed *feed, const km_kv_event *e, bool lora_set, uint32_t i)
{
    if (feed->config.extra_keys_policy != KM_FEED_EXTRA_KEYS_SKIP)
        return false;
    if (e->extra_keys_opaque)
        return e->extra_keys_opaque[i] != 0;
    return e->extra_keys_present && !lora_set && e->extra_keys_present[i];
}

/* The window groups `groups` now hold the event's blocks: one STORE of their window keys per group,
 * over the event's blocks up to the first without a chain (room reserved by the caller: one update
 * per group, one hash per block and group). Keys already held are stored again, harmlessly. */
static void queue_window_stores(km_feed *feed, const worker *w, const km_kv_event *e,
                                uint32_t groups, uint64_t parent_chain)
{
    for (; groups; groups &= groups - 1) {
        uint32_t g = (uint32_t)__builtin_ctz(groups);
        uint64_t offset = feed->hash_count, count = 0;
        for (uint32_t i = 0; i < e->n_block_hashes; i++) {
            const km_emap_entry *m = km_emap_find(&w->map, e->block_hashes[i]);
            if (!m || m->chain == CHAIN_UNHASHABLE)
                break;
            feed->hashes[offset + count++] = km_hash_window_key(m->chain, g);
        }
        if (!count)
            return;
        feed->hash_count += count;
        queue_push(feed, KM_UPDATE_STORE, w->id,
                   parent_chain == KM_NO_PARENT ? KM_NO_PARENT
                                                : km_hash_window_key(parent_chain, g),
                   offset, count);
    }
}

/* A window group's store of some blocks of a range (sparse_blocks): each engine hash the map knows
 * with a chain, held on the GPU by another group, is that block, now held by this group too; its
 * window key is stored, one update per block (the blocks need not be consecutive). True when
 * every block was placed. Room: the caller's reservation for a store that splits at every
 * block. */
static bool place_window_blocks(km_feed *feed, worker *w, const km_kv_event *e)
{
    uint32_t gbit = group_bit(e);
    if (e->medium != KM_KV_MEDIUM_GPU || !(window_mask(w) & gbit))
        return false;
    uint32_t placed = 0;
    for (uint32_t i = 0; i < e->n_block_hashes; i++) {
        km_emap_entry *m = km_emap_find(&w->map, e->block_hashes[i]);
        if (!m || m->chain == CHAIN_UNHASHABLE || !(m->media & MEDIUM_BIT_GPU))
            continue;
        gain_copy(m, gbit);
        m->gpu_groups |= gbit;
        feed->hashes[feed->hash_count] = km_hash_window_key(m->chain, e->group_idx);
        queue_push(feed, KM_UPDATE_STORE, w->id, KM_NO_PARENT, feed->hash_count++, 1);
        placed++;
    }
    w->stores_applied++;
    w->c.stored_by_medium[medium_index(e->medium)] += placed;
    return placed == e->n_block_hashes;
}

/* An engine hash names one block (its parent, tokens and extra keys). A BlockStored of an engine
 * hash the worker already holds is that same block arriving in another medium (vLLM's CPU
 * offloading connector announces its copies so, with extra_keys nil), or the same medium again
 * (on the GPU in a group holding it: another copy, counted as above): it adds its medium and never
 * renames the block. The chain hash (or the unhashable mark) the
 * first store gave it stays until the block has left every medium, so the index holds exactly one
 * chain per held engine hash, the one a BlockRemoved will remove. A new block after a held one is
 * chained from the held chain. */
static void apply_stored(km_feed *feed, worker *w, const km_kv_event *e)
{
    uint32_t n = e->n_block_hashes;
    if (n == 1 && e->has_group_idx && e->block_size < feed->config.block_size) {
        /* A partial prefix entry of a hybrid model's group: lookup metadata for a prefix that
         * ends inside a block, which no full-block chain names. Skipping it can only make the
         * index hold less than the engine. */
        km_feed_count_refusal(w, KM_FEED_REFUSED_PARTIAL_BLOCK, 1,
                              "BlockStored of a partial block (hybrid model group)");
        return;
    }
    if (e->sparse_blocks) {
        /* Some blocks of a range, which ones unsaid. A window group's (Mamba's kept states) are
         * placed by their engine hashes where the map knows them (another group stored them);
         * the rest are skipped. A required group still counts among the engine's groups
         * (km_feed_queue_message), so no block counts without it: the index holds less than
         * the engine, never more. */
        if (!place_window_blocks(feed, w, e))
            km_feed_count_refusal(w, KM_FEED_REFUSED_PARTIAL_BLOCK, 1,
                                  "BlockStored of some blocks of a range (hybrid model group)");
        return;
    }
    if (e->block_size != feed->config.block_size) {
        char example[96];
        snprintf(example, sizeof example, "BlockStored with block_size %u, the pool's is %u",
                 e->block_size, feed->config.block_size);
        w->c.block_size_mismatch++;
        w->stores_refused_for_config++;
        km_feed_count_refusal(w, KM_FEED_REFUSED_BLOCK_SIZE, 1, example);
        return;
    }
    if (e->n_lookahead_tokens != feed->config.hash_lookahead_tokens) {
        char example[112];
        snprintf(example, sizeof example,
                 "BlockStored with %u lookahead tokens per block, the pool hashes %u",
                 e->n_lookahead_tokens, feed->config.hash_lookahead_tokens);
        w->stores_refused_for_config++;
        km_feed_count_refusal(w, KM_FEED_REFUSED_LOOKAHEAD, 1, example);
        return;
    }
    uint32_t gbit = group_bit(e);
    if (gbit == GROUP_BIT_UNTRACKED && e->medium == KM_KV_MEDIUM_GPU) {
        /* Its group's blocks are never known, so no GPU block of the worker counts any more. */
        char example[96];
        snprintf(example, sizeof example, "BlockStored of KV-cache group %u (groups from %u up "
                 "are not told apart)", e->group_idx, GROUP_BITS_TRACKED);
        km_feed_count_refusal(w, KM_FEED_REFUSED_INVALID_EVENT, 1, example);
        return;
    }
    uint32_t required = required_groups(w), windows = window_mask(w);
    w->stores_applied++;
    count_unknown_medium(w, e);
    w->c.stored_by_medium[medium_index(e->medium)] += n;
    if (n == 0)
        return;
    uint8_t bit = medium_bit(e->medium);

    uint64_t parent_chain = KM_NO_PARENT;
    bool starts_sequence = true;
    if (e->has_parent_block_hash) {
        const km_emap_entry *p = km_emap_find(&w->map, e->parent_block_hash);
        if (!p) {
            w->c.unknown_parent_blocks += n;
            km_feed_count_refusal(w, KM_FEED_REFUSED_UNKNOWN_PARENT, 1,
                                  "BlockStored whose parent block is not known");
            return;
        }
        parent_chain = p->chain;
        starts_sequence = false;
    }

    /* LoRA: the adapter name; an engine that sends only the deprecated lora_id gets a name derived
     * from it, so that adapter blocks never pass for base-model blocks. */
    char lora_buf[40];
    const char *lora = e->lora_name;
    if ((!lora || !lora[0]) && e->has_lora_id) {
        snprintf(lora_buf, sizeof lora_buf, "#lora_id=%" PRId64, e->lora_id);
        lora = lora_buf;
    }
    bool lora_set = lora && lora[0];
    /* The salt names block 0 only, so it matters only for a run that starts a sequence. */
    km_hash_config hc = {feed->config.block_size, lora_set ? lora : NULL,
                         starts_sequence ? e->cache_salt : NULL};
    /* Past block 0 only the LoRA name counts: without one, the seed is KM_HASH_SEED. */
    uint64_t seed_rest = lora_set ? km_hash_block_seed(&hc, 1) : KM_HASH_SEED;
    uint64_t seed_first = starts_sequence ? km_hash_block_seed(&hc, 0) : seed_rest; /* root only */

    /* Blocks [0, hashable) have chains and form the STORE run; the first block without one (an
     * opaque block, one after an unhashable parent or block, one held as unhashable) ends it, and
     * every later new block of the event is unhashable too. A hashable block that does not count
     * yet (a KV-cache group lacks it) is left out: it splits the run, and the blocks after it
     * form a run of their own from it (an orphan run for the index). */
    uint64_t offset = feed->hash_count;
    uint64_t *chains = feed->hashes + offset;
    km_tier event_tier = best_tier(bit);
    bool run_open = starts_sequence || parent_chain != CHAIN_UNHASHABLE;
    uint64_t previous = parent_chain, run_parent = starts_sequence ? KM_NO_PARENT : parent_chain;
    uint32_t hashable = 0, run_first = 0, unhashable = 0, n_fixes = 0;
    /* Each upsert is likely a cache miss, and hashing a block between two of them keeps the next
     * from starting: load the map slots a few blocks ahead (docs/BENCHMARKS.md, "Events"). */
    for (uint32_t i = 0; i < n && i < EMAP_PREFETCH_AHEAD; i++)
        km_emap_prefetch(&w->map, e->block_hashes[i]);
    for (uint32_t i = 0; i < n; i++) {
        if (i + EMAP_PREFETCH_AHEAD < n)
            km_emap_prefetch(&w->map, e->block_hashes[i + EMAP_PREFETCH_AHEAD]);
        km_emap_entry *m = km_emap_upsert(&w->map, e->block_hashes[i]);
        bool held = m->media != 0; /* a held entry always has a medium; a new one has none */
        bool counted_before = held && entry_counts(m, required);
        km_tier tier_before = best_tier(m->media);
        if (!held) {
            feed->new_keys[feed->new_key_count++] = e->block_hashes[i]; /* reserved */
            /* Room reserved with the entry's (km_emap_reserve): a parent is never lost here. */
            (void)km_emap_set_parent(&w->map, m,
                                     i ? km_u64map_key(e->block_hashes[i - 1])
                                       : starts_sequence ? 0
                                                         : km_u64map_key(e->parent_block_hash));
            if (run_open && !block_is_opaque(feed, e, lora_set, i)) {
                bool root = starts_sequence && i == 0;
                uint32_t la = e->n_lookahead_tokens, bs = feed->config.block_size;
                const uint32_t *tokens = e->token_ids + (size_t)i * bs;
                uint64_t seed = root ? seed_first : seed_rest;
                /* km_hash_local is km_hash_local_lookahead without lookahead tokens. */
                const uint32_t *ahead = la ? e->lookahead_token_ids + (size_t)i * la : NULL;
                uint64_t local = la ? km_hash_local_lookahead(tokens, bs, ahead, la, seed)
                                    : km_hash_local(tokens, bs, seed);
                m->chain = root ? km_hash_chain_root(local) : km_hash_chain_step(previous, local);
            } else {
                m->chain = CHAIN_UNHASHABLE;
            }
        }
        if (bit == MEDIUM_BIT_GPU) {
            gain_copy(m, gbit);
            m->gpu_groups |= gbit;
            m->media |= bit;
        } else {
            gain_hold(w, m, e->medium);
        }
        if (m->chain == CHAIN_UNHASHABLE) {
            run_open = false;
            unhashable++;
            continue;
        }
        km_tier tier_now = best_tier(m->media);
        if (run_open && !entry_counts(m, required)) {
            if (hashable > run_first) {
                queue_push(feed, KM_UPDATE_STORE, w->id, run_parent, offset + run_first,
                           hashable - run_first);
                feed->queue[feed->queue_count - 1].tier = event_tier;
            }
            run_first = hashable;
            run_parent = previous = m->chain;
            continue;
        }
        if (run_open) {
            chains[hashable++] = m->chain;
            previous = m->chain;
            /* The STORE below says event_tier; a block held in a faster medium keeps its tier. */
            if (tier_now != event_tier) {
                feed->tier_chains[n_fixes] = m->chain;
                feed->tier_scratch[n_fixes++] = (uint8_t)tier_now;
            }
        } else if (counted_before && tier_now != tier_before) {
            /* Held with a chain but past the run (after an unhashable block): no STORE names it,
             * so a faster new medium reaches the index as a tier change alone. (One that starts
             * to count only now is left out of the index: less than the engine holds.) */
            feed->tier_chains[n_fixes] = m->chain;
            feed->tier_scratch[n_fixes++] = (uint8_t)tier_now;
        }
    }
    if (hashable > run_first) {
        queue_push(feed, KM_UPDATE_STORE, w->id, run_parent, offset + run_first,
                   hashable - run_first);
        feed->queue[feed->queue_count - 1].tier = event_tier;
    }
    feed->hash_count += hashable;
    w->c.blocks_stored += hashable;
    if (n_fixes)
        queue_tier_fixes(feed, w->id, feed->tier_chains, feed->tier_scratch, n_fixes,
                         (km_tier)KM_TIER_COUNT /* none: every listed block needs its update */);
    w->c.unhashable_blocks += unhashable;
    uint32_t gained = bit == MEDIUM_BIT_GPU ? gbit & windows : windows;
    if (gained && (starts_sequence || parent_chain != CHAIN_UNHASHABLE))
        queue_window_stores(feed, w, e, gained, starts_sequence ? KM_NO_PARENT : parent_chain);
}

/* A placeholder store (km_kv_event.placeholder: vLLM's OffloadingConnector without
 * self-describing events) names each chunk it stored by its key, the engine hash of the chunk's
 * last block. The chunk is that block and the offload_chunk_blocks - 1 blocks before it in its
 * sequence (chunks start at multiples of offload_chunk_blocks from the sequence's first block),
 * which the feed finds through the map entries' parents. Each block of the chunk the map holds (a
 * full store announced it, and some medium still holds it) gets one announcement in the event's
 * medium, exactly as a self-describing store of the chunk would give it, and moves to a faster
 * tier when that becomes its best one; its chain hash, parent and position stay what the full
 * store gave it. The walk goes from the key backwards and stops at the first block the map does
 * not hold (or at a sequence's first block): the blocks before it are not placed, and the chunk
 * is counted as unplaced_placeholder, never an error. Every block placed is one the engine holds
 * in that medium, and a prefix through an unplaced block stops at it in the index, so the
 * prediction stays at or below the engine's hit. So is every placeholder of an engine with more
 * than one KV-cache group: its per-group offloads say nothing about the other groups, and a
 * medium other than the GPU counts as the whole block. With one group every held hashable entry
 * already counts, so a placeholder changes at most a tier in the index. */
static void apply_placeholder(km_feed *feed, worker *w, const km_kv_event *e)
{
    uint32_t n = e->n_block_hashes;
    uint32_t groups = w->gpu_groups;
    w->placeholder_chunks = true;
    if (e->medium == KM_KV_MEDIUM_GPU) { /* the decoder never delivers one: nothing to walk */
        km_feed_count_refusal(w, KM_FEED_REFUSED_INVALID_EVENT, n,
                              "placeholder BlockStored on the GPU");
        return;
    }
    if ((groups & (groups - 1)) != 0 || (groups && !(groups & group_bit(e)))) {
        km_feed_count_refusal(
            w, KM_FEED_REFUSED_UNPLACED_PLACEHOLDER, n,
            "placeholder BlockStored: the engine has other or more KV-cache groups");
        return;
    }
    count_unknown_medium(w, e);
    uint32_t chunk = feed->config.offload_chunk_blocks;
    uint32_t required = required_groups(w), placed = 0, unplaced = 0, n_fixes = 0;
    bool key_unknown = false;
    for (uint32_t i = 0; i < n; i++) {
        km_emap_entry *m = km_emap_find(&w->map, e->block_hashes[i]);
        key_unknown |= m == NULL;
        uint32_t walked = 0;
        for (; m && walked < chunk; walked++) {
            bool counted_before = entry_counts(m, required);
            km_tier tier_before = best_tier(m->media);
            gain_hold(w, m, e->medium);
            km_tier tier_now = best_tier(m->media);
            if (counted_before && tier_now != tier_before) {
                feed->tier_chains[n_fixes] = m->chain;
                feed->tier_scratch[n_fixes++] = (uint8_t)tier_now;
            }
            uint64_t parent = walked + 1 < chunk ? km_emap_parent(&w->map, m) : 0;
            m = parent ? km_emap_find(&w->map, parent) : NULL;
        }
        placed += walked;
        unplaced += walked < chunk;
    }
    w->stores_applied++;
    w->c.stored_by_medium[medium_index(e->medium)] += placed;
    if (n_fixes)
        queue_tier_fixes(feed, w->id, feed->tier_chains, feed->tier_scratch, n_fixes,
                         (km_tier)KM_TIER_COUNT /* none: every listed block needs its update */);
    if (unplaced) {
        char example[128];
        snprintf(example, sizeof example,
                 key_unknown
                     ? "placeholder BlockStored (medium %s) of a block not held in any medium"
                     : "placeholder BlockStored (medium %s) of a chunk whose earlier blocks are "
                       "not held",
                 km_kv_medium_name(e->medium));
        km_feed_count_refusal(w, KM_FEED_REFUSED_UNPLACED_PLACEHOLDER, unplaced, example);
    }
}

static void apply_removed(km_feed *feed, worker *w, const km_kv_event *e)
{
    uint32_t n = e->n_block_hashes;
    count_unknown_medium(w, e);
    w->c.removed_by_medium[medium_index(e->medium)] += n;
    uint8_t bit = medium_bit(e->medium);
    uint64_t offset = feed->hash_count;
    uint64_t count = 0;
    uint32_t n_moved = 0, required = required_groups(w), windows = window_mask(w);
    uint64_t window_count = 0;
    /* An engine announcing its chunks by placeholders removes a chunk by its key: the walk of
     * apply_placeholder finds its blocks again. */
    uint32_t chunk = bit != MEDIUM_BIT_GPU && w->placeholder_chunks
                         ? feed->config.offload_chunk_blocks
                         : 1;
    for (uint32_t i = 0; i < n; i++) {
        km_emap_entry *m = km_emap_find(&w->map, e->block_hashes[i]);
        if (!m) {
            w->c.unknown_removes++;
            continue;
        }
        uint64_t parent = 0;
        for (uint32_t walked = 0; m;
             m = ++walked < chunk && parent ? km_emap_find(&w->map, parent) : NULL) {
            parent = km_emap_parent(&w->map, m);
            if (bit == MEDIUM_BIT_GPU && drop_copy(m, group_bit(e)))
                continue; /* another copy stays in the group: nothing the index sees changes */
            if (bit != MEDIUM_BIT_GPU && drop_hold(w, m, e->medium))
                continue; /* another announcement keeps it in the medium: nothing changes */
            uint8_t before = m->media;
            bool counted_before = entry_counts(m, required);
            uint32_t windows_before = entry_windows(m, windows);
            if (bit == MEDIUM_BIT_GPU) {
                /* The GPU copy goes when the last KV-cache group holding it let it go. */
                m->gpu_groups &= ~group_bit(e);
                if (!m->gpu_groups)
                    m->media &= (uint8_t)~bit;
            } else {
                leave_medium(w, m, e->medium);
            }
            /* A window group that let the block go: its window key goes, in the same REMOVE. */
            uint32_t lost = windows_before & ~entry_windows(m, windows);
            if (lost) {
                uint32_t k = window_keys(feed->hashes + offset + count, m->chain, lost);
                count += k;
                window_count += k;
            }
            if (m->media) {
                if (!counted_before)
                    continue;
                if (!entry_counts(m, required)) {
                    /* A KV-cache group let it go: the engine's hit stops before it. */
                    feed->hashes[offset + count++] = m->chain;
                } else if (best_tier(m->media) != best_tier(before)) {
                    /* Still held in another medium; its tier changes when the fastest copy went. */
                    feed->tier_chains[n_moved] = m->chain;
                    feed->tier_scratch[n_moved++] = (uint8_t)best_tier(m->media);
                }
                continue;
            }
            uint64_t chain = m->chain;
            km_emap_erase(&w->map, m);
            if (!counted_before)
                continue;
            feed->hashes[offset + count++] = chain;
        }
    }
    if (count) {
        feed->hash_count += count;
        queue_push(feed, KM_UPDATE_REMOVE, w->id, KM_NO_PARENT, offset, count);
        w->c.blocks_removed += count - window_count;
    }
    if (n_moved)
        queue_tier_fixes(feed, w->id, feed->tier_chains, feed->tier_scratch, n_moved,
                         (km_tier)KM_TIER_COUNT /* none: every moved block needs its update */);
}

/* Queue the updates of a well-formed message's events as one group; a message whose updates do not
 * fit (the queue's limit, or no memory) is dropped and its worker DEGRADED. */
void km_feed_queue_message(km_feed *feed, worker *w, const message_view *v, uint64_t now)
{
    size_t n_hashes = 0, n_stored = 0, n_store_events = 0;
    uint32_t groups = w->gpu_groups, window_groups = w->window_groups;
    for (uint32_t i = 0; i < v->n_events; i++) {
        const km_kv_event *e = &v->events[i];
        /* A placeholder and a removal off the GPU may name chunk keys: a chunk's blocks each. */
        bool chunks = e->medium != KM_KV_MEDIUM_GPU &&
                      (e->placeholder || e->kind == KM_KV_EVENT_BLOCK_REMOVED);
        n_hashes += (size_t)e->n_block_hashes * (chunks ? feed->config.offload_chunk_blocks : 1);
        if (e->kind != KM_KV_EVENT_BLOCK_STORED)
            continue;
        n_stored += e->n_block_hashes;
        n_store_events++;
        if (e->medium != KM_KV_MEDIUM_GPU)
            continue;
        uint32_t gbit = group_bit(e);
        /* A group is a window group when its first GPU store says so. */
        uint32_t blocks = 0;
        if (!(groups & gbit) && gbit != GROUP_BIT_UNTRACKED)
            blocks = window_blocks_of(e, feed->config.block_size);
        if (blocks) {
            window_groups |= gbit;
            w->window_blocks[e->group_idx] = blocks;
        }
        groups |= gbit;
    }
    /* A KV-cache group seen for the first time: blocks that stop counting (the new group is
     * required and does not hold them, or a window group's keys leave with the rule) go in one
     * REMOVE. With more than one group a store may split its run at every block that does not
     * count: up to one more update per stored block; with window groups each store event stores
     * their keys, and a removed block removes its keys, one hash per block and group. */
    uint32_t windows_before = window_mask(w), windows_after = window_mask_of(groups, window_groups);
    uint32_t n_windows_before = (uint32_t)__builtin_popcount(windows_before);
    uint32_t n_windows_after = (uint32_t)__builtin_popcount(windows_after);
    bool new_group = groups != w->gpu_groups, several_groups = (groups & (groups - 1)) != 0;
    size_t extra_updates = (new_group ? 1 : 0) + (several_groups ? n_stored : 0) +
                           n_store_events * n_windows_after;
    size_t extra_hashes = (new_group ? km_emap_live(&w->map) * (1 + (size_t)n_windows_before) : 0) +
                          n_hashes * n_windows_after;
    /* The bound holds for the updates too: an AllBlocksCleared on an empty map queues an update
     * naming no hash, one per event. */
    if (feed->hash_count + n_hashes > feed->config.max_queued_hashes ||
        feed->queue_count + v->n_events > feed->config.max_queued_hashes) {
        w->c.dropped_messages++;
        km_feed_enter_degraded(feed, w, now, "update queue full (flush not called often enough)");
        return;
    }
    /* Per event: its update plus up to one SET_TIER per tier; per block: its hash plus one for a
     * tier fix. */
    if (queue_reserve(feed, (size_t)v->n_events * (1 + KM_TIER_COUNT) + extra_updates,
                      2 * n_hashes + extra_hashes) ||
        tier_scratch_reserve(feed, n_hashes) || km_emap_reserve(&w->map, n_stored) ||
        GROW(feed->new_keys, feed->new_key_capacity, feed->new_key_count + n_stored)) {
        w->c.dropped_messages++;
        km_feed_enter_degraded(feed, w, now, "out of memory queueing a message's updates");
        return;
    }
    /* An engine's step holds several short events: start every map slot the message will look up
     * (parents and blocks, up to MESSAGE_PREFETCH_KEYS) before the first, so their misses overlap
     * instead of each event waiting on its own. */
    uint32_t prefetched = 0;
    for (uint32_t i = 0; i < v->n_events && prefetched < MESSAGE_PREFETCH_KEYS; i++) {
        const km_kv_event *e = &v->events[i];
        if (e->kind == KM_KV_EVENT_BLOCK_STORED && e->has_parent_block_hash) {
            km_emap_prefetch(&w->map, e->parent_block_hash);
            prefetched++;
        }
        for (uint32_t k = 0; k < e->n_block_hashes && prefetched < MESSAGE_PREFETCH_KEYS; k++) {
            km_emap_prefetch(&w->map, e->block_hashes[k]);
            prefetched++;
        }
    }
    group_begin(feed, w);
    if (new_group) {
        /* Blocks that start to count under the new groups (held by the groups no longer
         * required) are not stored now: less than the engine holds until they are stored again. */
        uint32_t required_before = required_groups(w), required_after = groups & ~windows_after;
        uint64_t offset = feed->hash_count, count = 0, window_count = 0, cursor = 0;
        for (const km_emap_entry *m; (m = km_emap_next(&w->map, &cursor));) {
            if (entry_counts(m, required_before) && !entry_counts(m, required_after))
                feed->hashes[offset + count++] = m->chain;
            uint32_t k = window_keys(feed->hashes + offset + count, m->chain,
                                     entry_windows(m, windows_before) & ~windows_after);
            count += k;
            window_count += k;
        }
        w->gpu_groups = groups;
        w->window_groups = window_groups;
        if (count) {
            feed->hash_count += count;
            queue_push(feed, KM_UPDATE_REMOVE, w->id, KM_NO_PARENT, offset, count);
            w->c.blocks_removed += count - window_count;
        }
    }
    for (uint32_t i = 0; i < v->n_events; i++) {
        const km_kv_event *e = &v->events[i];
        switch (e->kind) {
        case KM_KV_EVENT_BLOCK_STORED:
            if (e->placeholder)
                apply_placeholder(feed, w, e);
            else
                apply_stored(feed, w, e);
            break;
        case KM_KV_EVENT_BLOCK_REMOVED: apply_removed(feed, w, e); break;
        case KM_KV_EVENT_ALL_BLOCKS_CLEARED:
            w->c.clears++;
            queue_clear(feed, w, KM_UPDATE_CLEAR_WORKER);
            km_emap_clear(&w->map);
            /* Everything stored from here on is observed: the index is complete again. */
            km_feed_exit_degraded(feed, w, now, KM_FEED_END_CLEARED);
            break;
        }
    }
    /* Its events count as applied when the index takes its updates (km_feed_flush); one that
     * queued none is applied already. */
    if (group_end(feed))
        feed->groups[feed->group_count - 1].events = v->n_events;
    else
        w->c.events += v->n_events;
}

/* ---- flush ----------------------------------------------------------------------------------- */

static void accumulate(km_update_stats *sum, const km_update_stats *s)
{
    sum->stored += s->stored;
    sum->duplicate_stores += s->duplicate_stores;
    sum->removed += s->removed;
    sum->absent_removes += s->absent_removes;
    sum->cleared += s->cleared;
    sum->orphan_runs += s->orphan_runs;
    sum->tier_changes += s->tier_changes;
    sum->absent_tier_changes += s->absent_tier_changes;
    sum->clear_scans += s->clear_scans;
}

void km_feed_flush_stats_add(km_feed_flush_stats *sum, const km_feed_flush_stats *s)
{
    sum->updates += s->updates;
    sum->groups += s->groups;
    sum->groups_failed += s->groups_failed;
    accumulate(&sum->index, &s->index);
}

static void queue_reset(km_feed *feed)
{
    feed->queue_count = feed->group_count = feed->hash_count = feed->new_key_count = 0;
    feed->hash_reserved = 0;
}

/* The groups [0, n) were applied: their events count as applied. */
static void count_applied(km_feed *feed, const queued_group *groups, size_t n)
{
    worker *w = NULL;
    for (size_t g = 0; g < n; g++) {
        if (!w || w->id != groups[g].worker)
            w = km_feed_find_worker(feed, groups[g].worker);
        if (w && w->generation == groups[g].generation)
            w->c.events += groups[g].events;
    }
}

/* Everything applied so far is in the index (or dropped, its worker DEGRADED): the positions
 * info reports catch up. */
static void publish_positions(km_feed *feed)
{
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        worker *w = feed->workers[i];
        w->has_flushed_expected = w->has_expected;
        w->flushed_expected = w->expected;
    }
}

/* The first n rule clears: the rules of workers removed before their removal was applied. */
static void clear_removed_rules(km_feed *feed, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        worker *w = km_feed_find_worker(feed, feed->rule_clears[i]);
        if (!w) /* else added again under the id: its own rule replaces this one at a sync */
            km_index_set_worker_windows(feed->index, feed->rule_clears[i], NULL, 0);
    }
    if (n == 0)
        return; /* rule_clears may be NULL */
    memmove(feed->rule_clears, feed->rule_clears + n,
            (feed->rule_clear_count - n) * sizeof *feed->rule_clears);
    feed->rule_clear_count -= n;
}

/* Set w's rule in the index: the groups `windows`, blocks[k] the k-th one's window in blocks. */
static void set_index_rule(km_feed *feed, worker *w, uint32_t windows, const uint32_t *blocks)
{
    km_window_group rule[KM_MAX_WINDOW_GROUPS];
    uint32_t n = 0;
    for (uint32_t g = windows; g; g &= g - 1)
        rule[n] = (km_window_group){(uint32_t)__builtin_ctz(g), blocks[n]}, n++;
    /* Fails only without memory for the first rule's table: retried at every flush. */
    w->index_rule_failed = km_index_set_worker_windows(feed->index, w->id, rule, n) != KM_OK;
    if (!w->index_rule_failed)
        w->index_window_groups = windows;
}

/* A rule to set: w's window groups with their blocks, into blocks (popcount(windows) of them);
 * whether it differs from the index's. */
static bool rule_to_sync(const worker *w, uint32_t *windows, uint32_t *blocks)
{
    *windows = window_mask(w);
    uint32_t n = 0;
    for (uint32_t g = *windows; g; g &= g - 1)
        blocks[n++] = w->window_blocks[__builtin_ctz(g)];
    return *windows != w->index_window_groups || w->index_rule_failed;
}

void km_feed_sync_window_rules(km_feed *feed)
{
    clear_removed_rules(feed, feed->rule_clear_count);
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        worker *w = feed->workers[i];
        uint32_t windows, blocks[KM_MAX_WINDOW_GROUPS];
        if (rule_to_sync(w, &windows, blocks))
            set_index_rule(feed, w, windows, blocks);
    }
}

/* The rules as of km_feed_flush_take, once the taken updates are in the index: what was queued
 * since (a worker's first window group, a removal) is synced with its own updates, at a later
 * flush, so scoring never sees a rule ahead of the blocks it governs. */
static void sync_taken_window_rules(km_feed *feed)
{
    const taken_queue *t = &feed->taken;
    clear_removed_rules(feed, t->n_rule_clears);
    for (size_t i = 0; i < t->n_positions; i++) {
        const taken_position *p = &t->positions[i];
        worker *w = p->sync_rule ? km_feed_find_worker(feed, p->worker) : NULL;
        if (w && w->generation == p->generation)
            set_index_rule(feed, w, p->windows,
                           p->windows ? t->window_blocks + p->window_blocks_at : NULL);
    }
}

static int flush_queue(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats);

/* The queue as the index's updates, into out (room for queue_count); their hashes point into
 * feed->hashes. */
static void queue_to_updates(const km_feed *feed, km_update *out)
{
    for (size_t i = 0; i < feed->queue_count; i++) {
        const queued_update *q = &feed->queue[i];
        km_update *u = &out[i];
        u->kind = q->kind;
        u->worker = q->worker;
        u->parent = q->parent;
        u->hashes = q->count ? feed->hashes + q->offset : NULL;
        u->n_hashes = q->count;
        u->tier = (km_tier)q->tier;
    }
}

int km_feed_flush(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats)
{
    int rc = flush_queue(feed, now_ns, stats);
    if (feed)
        km_feed_sync_window_rules(feed);
    return rc;
}

/* ---- a flush applied outside the caller's lock ------------------------------------------------ */

#define SWAP(a, b)                                                                                 \
    do {                                                                                           \
        __typeof__(a) swap_tmp_ = (a);                                                             \
        (a) = (b);                                                                                 \
        (b) = swap_tmp_;                                                                           \
    } while (0)

/* Exchange the feed's queue arrays (with their counts) and the taken ones. */
static void swap_queue(km_feed *feed)
{
    taken_queue *t = &feed->taken;
    SWAP(feed->queue, t->queue);
    SWAP(feed->queue_count, t->queue_count);
    SWAP(feed->queue_capacity, t->queue_capacity);
    SWAP(feed->groups, t->groups);
    SWAP(feed->group_count, t->group_count);
    SWAP(feed->group_capacity, t->group_capacity);
    SWAP(feed->hashes, t->hashes);
    SWAP(feed->hash_count, t->hash_count);
    SWAP(feed->hash_capacity, t->hash_capacity);
    SWAP(feed->new_keys, t->new_keys);
    SWAP(feed->new_key_count, t->new_key_count);
    SWAP(feed->new_key_capacity, t->new_key_capacity);
    feed->hash_reserved = feed->hash_count; /* between messages: nothing is promised */
}

bool km_feed_flush_take(km_feed *feed)
{
    taken_queue *t = &feed->taken;
    if (feed->group_count == 0 || feed->group_open || feed->taken_in_flight)
        return false;
    if (GROW(t->scratch, t->scratch_capacity, feed->queue_count) ||
        GROW(t->positions, t->positions_capacity, feed->n_workers))
        return false; /* km_feed_flush_finish flushes under the lock instead */
    t->window_block_count = 0;
    for (uint32_t i = 0; i < feed->n_workers; i++) {
        const worker *w = feed->workers[i];
        taken_position *p = &t->positions[i];
        *p = (taken_position){w->id, w->generation, w->has_expected, w->expected, false, 0, 0};
        uint32_t blocks[KM_MAX_WINDOW_GROUPS];
        if (!rule_to_sync(w, &p->windows, blocks))
            continue;
        uint32_t n = (uint32_t)__builtin_popcount(p->windows);
        if (GROW(t->window_blocks, t->window_block_capacity, t->window_block_count + n))
            return false;
        p->sync_rule = true;
        p->window_blocks_at = t->window_block_count;
        if (n) /* a rule to clear has no blocks, and window_blocks may still be NULL */
            memcpy(t->window_blocks + t->window_block_count, blocks, n * sizeof *blocks);
        t->window_block_count += n;
    }
    queue_to_updates(feed, t->scratch);
    t->n_positions = feed->n_workers;
    t->n_rule_clears = feed->rule_clear_count;
    t->queue_count = t->group_count = t->hash_count = t->new_key_count = 0;
    swap_queue(feed); /* the scratch keeps pointing into the hashes, which move with the queue */
    t->status = KM_OK;
    memset(&t->applied, 0, sizeof t->applied);
    feed->taken_in_flight = true;
    return true;
}

bool km_feed_flush_in_flight(const km_feed *feed)
{
    return feed->taken_in_flight;
}

/* The index took updates u[0..n): config.on_stored hears of their stores. */
static void tell_stored(const km_feed *feed, const km_update *u, size_t n)
{
    if (!feed->config.on_stored)
        return;
    for (size_t i = 0; i < n; i++)
        if (u[i].kind == KM_UPDATE_STORE && u[i].n_hashes)
            feed->config.on_stored(feed->config.on_stored_user, u[i].worker, u[i].hashes,
                                   u[i].n_hashes);
}

void km_feed_flush_apply(km_feed *feed)
{
    taken_queue *t = &feed->taken;
    t->status = km_index_apply(feed->index, t->scratch, t->queue_count, &t->applied);
    if (t->status == KM_OK)
        tell_stored(feed, t->scratch, t->queue_count);
}

/* Append the feed's queue to the taken one (offsets moved past it) and make that the feed's
 * queue: what was queued during the apply comes after what was taken, as if never taken. */
static int put_taken_back(km_feed *feed)
{
    taken_queue *t = &feed->taken;
    if (GROW(t->queue, t->queue_capacity, t->queue_count + feed->queue_count) ||
        GROW(t->groups, t->group_capacity, t->group_count + feed->group_count) ||
        GROW(t->hashes, t->hash_capacity, t->hash_count + feed->hash_count) ||
        GROW(t->new_keys, t->new_key_capacity, t->new_key_count + feed->new_key_count))
        return KM_ERR_OUT_OF_MEMORY;
    for (size_t i = 0; i < feed->queue_count; i++) {
        queued_update q = feed->queue[i];
        q.offset += t->hash_count;
        t->queue[t->queue_count + i] = q;
    }
    for (size_t i = 0; i < feed->group_count; i++) {
        queued_group g = feed->groups[i];
        g.first += t->queue_count;
        g.first_key += t->new_key_count;
        t->groups[t->group_count + i] = g;
    }
    if (feed->hash_count)
        memcpy(t->hashes + t->hash_count, feed->hashes, feed->hash_count * sizeof *t->hashes);
    if (feed->new_key_count)
        memcpy(t->new_keys + t->new_key_count, feed->new_keys,
               feed->new_key_count * sizeof *t->new_keys);
    t->queue_count += feed->queue_count;
    t->group_count += feed->group_count;
    t->hash_count += feed->hash_count;
    t->new_key_count += feed->new_key_count;
    swap_queue(feed);
    t->queue_count = t->group_count = t->hash_count = t->new_key_count = 0;
    return KM_OK;
}

/* Each worker still followed under the same incarnation is indexed up to its position as of the
 * take. */
static void publish_taken_positions(km_feed *feed)
{
    const taken_queue *t = &feed->taken;
    for (size_t i = 0; i < t->n_positions; i++) {
        const taken_position *p = &t->positions[i];
        worker *w = km_feed_find_worker(feed, p->worker);
        if (w && w->generation == p->generation) {
            w->has_flushed_expected = p->has_expected;
            w->flushed_expected = p->expected;
        }
    }
}

int km_feed_flush_finish(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats)
{
    if (!feed->taken_in_flight)
        return km_feed_flush(feed, now_ns, stats);
    taken_queue *t = &feed->taken;
    feed->taken_in_flight = false;
    if (t->status != KM_OK) {
        if (put_taken_back(feed) == KM_OK)
            return km_feed_flush(feed, now_ns, stats);
        /* No memory to put it back in front: the taken batch alone takes the refusal path now,
         * and what was queued since stays for the next flush. An index error that would keep
         * the batch queued drops it instead, its workers DEGRADED (their index is incomplete). */
        swap_queue(feed);
        int rc = flush_queue(feed, now_ns, stats);
        swap_queue(feed);
        publish_taken_positions(feed); /* the flush published the current ones */
        sync_taken_window_rules(feed);
        for (size_t g = 0; g < t->group_count; g++) {
            worker *w = km_feed_find_worker(feed, t->groups[g].worker);
            if (w && w->generation == t->groups[g].generation && !w->degraded)
                km_feed_enter_degraded(feed, w, now_ns, "the index refused a message's updates");
        }
        t->queue_count = t->group_count = t->hash_count = t->new_key_count = 0;
        return rc;
    }
    km_feed_flush_stats local;
    if (!stats)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    feed->last_error[0] = '\0';
    count_applied(feed, t->groups, t->group_count);
    stats->updates = t->queue_count;
    stats->groups = t->group_count;
    stats->index = t->applied;
    publish_taken_positions(feed);
    t->queue_count = t->group_count = t->hash_count = t->new_key_count = 0;
    if (feed->group_count == 0)
        publish_positions(feed); /* nothing queued since: the positions are the current ones */
    sync_taken_window_rules(feed);
    return KM_OK;
}

/* ---- a message the index refused ------------------------------------------------------------ */

/* A refused message is dropped, but the worker's map took its events in at queue time: the blocks
 * it removed, and with a clear every block before it, are gone from the map, so no later removal
 * could name them. Its REMOVE and CLEAR_WORKER updates, in their order, go to the index anyway:
 * they never allocate, so the index takes them even at its memory cap, and the index then holds
 * for the worker no block the engine let go. Its stores and tier changes are lost (the worker is
 * DEGRADED for them). The group's scratch updates are reordered (rebuilt at every flush). */
static void apply_refused_removals(km_feed *feed, const queued_group *grp,
                                   km_feed_flush_stats *stats)
{
    km_update *u = feed->scratch + grp->first;
    size_t n = 0;
    for (size_t i = 0; i < grp->count; i++)
        if (u[i].kind == KM_UPDATE_REMOVE || u[i].kind == KM_UPDATE_CLEAR_WORKER)
            u[n++] = u[i];
    km_update_stats st;
    if (n && km_index_apply(feed->index, u, n, &st) == KM_OK) {
        stats->updates += n;
        accumulate(&stats->index, &st);
    }
}

/* What a group the index took did, as settle_refused_groups asks about it: an engine hash new to
 * its worker's map, an index key it stored (chain hash or window key), a clear (value 0). */
enum { FACT_NEW_KEY, FACT_STORED, FACT_CLEARED };

typedef struct group_fact {
    uint32_t worker;
    uint32_t kind;
    uint64_t value;
    size_t group; /* its index in the queue */
} group_fact;

static int fact_order(const void *pa, const void *pb)
{
    const group_fact *a = pa, *b = pb;
    if (a->worker != b->worker)
        return a->worker < b->worker ? -1 : 1;
    if (a->kind != b->kind)
        return a->kind < b->kind ? -1 : 1;
    if (a->value != b->value)
        return a->value < b->value ? -1 : 1;
    return a->group < b->group ? -1 : a->group > b->group;
}

static int fact_order_by_worker(const void *pa, const void *pb)
{
    const group_fact *a = pa, *b = pb;
    return a->worker < b->worker ? -1 : a->worker > b->worker;
}

/* Did a group after `group` do this (facts sorted by fact_order)? */
static bool fact_after(const group_fact *facts, size_t n, uint32_t id, uint32_t kind,
                       uint64_t value, size_t group)
{
    group_fact key = {id, kind, value, SIZE_MAX};
    size_t lo = 0, hi = n; /* the first fact above the key: the last of its kind is before it */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (fact_order(&facts[mid], &key) <= 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    const group_fact *f = lo ? &facts[lo - 1] : NULL;
    return f && f->worker == id && f->kind == kind && f->value == value && f->group > group;
}

/* The facts of the groups the index took that come after a refused group of the same worker
 * (first_refused: the first refused group of each such worker, sorted), into out when not NULL;
 * returns how many. Those groups are all of the worker's current incarnation: a refused group of
 * an older one is not settled. */
static size_t collect_facts(const km_feed *feed, const group_fact *first_refused, size_t n_workers,
                            group_fact *out)
{
    size_t n = 0;
    for (size_t g = 0; g < feed->group_count; g++) {
        const queued_group *grp = &feed->groups[g];
        if (grp->refused != KM_OK)
            continue;
        group_fact key = {grp->worker, 0, 0, 0};
        const group_fact *f =
            bsearch(&key, first_refused, n_workers, sizeof key, fact_order_by_worker);
        if (!f || f->group > g)
            continue;
        for (uint64_t k = 0; k < grp->n_keys; k++, n++)
            if (out)
                out[n] = (group_fact){grp->worker, FACT_NEW_KEY,
                                      feed->new_keys[grp->first_key + k], g};
        for (uint64_t u = grp->first; u < grp->first + grp->count; u++) {
            const queued_update *q = &feed->queue[u];
            if (q->kind == KM_UPDATE_CLEAR_WORKER) {
                if (out)
                    out[n] = (group_fact){grp->worker, FACT_CLEARED, 0, g};
                n++;
            } else if (q->kind == KM_UPDATE_STORE) {
                for (uint64_t h = 0; h < q->count; h++, n++)
                    if (out)
                        out[n] = (group_fact){grp->worker, FACT_STORED,
                                              feed->hashes[q->offset + h], g};
            }
        }
    }
    return n;
}

/* Did a group after `group` store the entry's block in the index (its chain or a window key)? */
static bool stored_after(const group_fact *facts, size_t n, const worker *w,
                         const km_emap_entry *m, size_t group)
{
    if (m->chain == CHAIN_UNHASHABLE)
        return false;
    if (fact_after(facts, n, w->id, FACT_STORED, m->chain, group))
        return true;
    for (uint32_t g = window_mask(w); g; g &= g - 1)
        if (fact_after(facts, n, w->id, FACT_STORED,
                       km_hash_window_key(m->chain, (uint32_t)__builtin_ctz(g)), group))
            return true;
    return false;
}

/* After the message-by-message flush (groups[g].refused set; the queue, its hashes and new keys
 * intact), for each of the n_failed refused groups of a worker's current incarnation:
 *  - the engine hashes it added to the map are forgotten (blocks the index never took must not
 *    hold memory outside its cap while the cap holds), except those a later group of the worker
 *    that the index took stored again: added them to the map anew, or stored their block's chain
 *    or window key; those the index holds, and only the map can name them to a later removal;
 *  - cleared_after says whether a later group of the worker that the index took cleared it (an
 *    AllBlocksCleared, a restart's or a resync's clear): then what the refused message stored is
 *    gone from the engine too, and its refusal leaves the worker's index complete. (A DROP-policy
 *    clear counts too: it is queued only while its worker is DEGRADED for a later loss, which
 *    that clear does not end.)
 * Without memory for this, nothing is forgotten and no refused group counts as cleared after:
 * the map may keep entries the index lacks (less than the engine holds, never more). */
static void settle_refused_groups(km_feed *feed, size_t n_failed)
{
    if (n_failed == 0)
        return;
    group_fact small[16];
    group_fact *first = n_failed <= 16 ? small : malloc(n_failed * sizeof *first);
    if (!first)
        return;
    size_t n_workers = 0;
    for (size_t g = 0; g < feed->group_count; g++)
        if (feed->groups[g].refused != KM_OK)
            first[n_workers++] = (group_fact){feed->groups[g].worker, 0, 0, g};
    qsort(first, n_workers, sizeof *first, fact_order); /* by worker, then group */
    size_t unique = 0;
    for (size_t i = 0; i < n_workers; i++)
        if (!unique || first[unique - 1].worker != first[i].worker)
            first[unique++] = first[i];
    n_workers = unique;
    size_t n_facts = collect_facts(feed, first, n_workers, NULL);
    group_fact *facts = n_facts ? malloc(n_facts * sizeof *facts) : NULL;
    if (n_facts && !facts) {
        if (first != small)
            free(first);
        return;
    }
    collect_facts(feed, first, n_workers, facts);
    if (first != small)
        free(first);
    if (n_facts)
        qsort(facts, n_facts, sizeof *facts, fact_order);
    for (size_t g = 0; g < feed->group_count; g++) {
        queued_group *grp = &feed->groups[g];
        if (grp->refused == KM_OK)
            continue;
        worker *w = km_feed_find_worker(feed, grp->worker);
        if (!w || w->generation != grp->generation)
            continue;
        grp->cleared_after = fact_after(facts, n_facts, w->id, FACT_CLEARED, 0, g);
        for (uint64_t k = 0; k < grp->n_keys; k++) {
            uint64_t key = feed->new_keys[grp->first_key + k];
            km_emap_entry *m = km_emap_find(&w->map, key);
            if (m && !fact_after(facts, n_facts, w->id, FACT_NEW_KEY, key, g) &&
                !stored_after(facts, n_facts, w, m, g))
                km_emap_erase(&w->map, m);
        }
    }
    free(facts);
}

/* Apply the queue as one index batch (message by message when the index refuses it). */
static int flush_queue(km_feed *feed, uint64_t now_ns, km_feed_flush_stats *stats)
{
    km_feed_flush_stats local;
    if (!stats)
        stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!feed)
        return KM_ERR_NULL_POINTER;
    feed->last_error[0] = '\0';
    if (feed->group_count == 0) {
        publish_positions(feed);
        return KM_OK;
    }
    if (GROW(feed->scratch, feed->scratch_capacity, feed->queue_count))
        return km_feed_fail(feed, KM_ERR_OUT_OF_MEMORY, "flush scratch");
    queue_to_updates(feed, feed->scratch);
    km_update_stats st;
    int rc = km_index_apply(feed->index, feed->scratch, feed->queue_count, &st);
    if (rc == KM_OK) {
        tell_stored(feed, feed->scratch, feed->queue_count);
        count_applied(feed, feed->groups, feed->group_count);
        stats->updates = feed->queue_count;
        stats->groups = feed->group_count;
        stats->index = st;
        queue_reset(feed);
        publish_positions(feed);
        return KM_OK;
    }
    if (rc != KM_ERR_MEMORY_CAP && rc != KM_ERR_OUT_OF_MEMORY)
        return km_feed_fail(feed, rc,
                            "index refused the batch: %s", km_index_last_error(feed->index));

    /* Message by message: each still all or nothing; a refused one is dropped, its removals and
     * clears still applied (apply_refused_removals). */
    int first_error = rc;
    char detail[192];
    snprintf(detail, sizeof detail, "%s", km_index_last_error(feed->index));
    size_t n_failed = 0;
    for (size_t g = 0; g < feed->group_count; g++) {
        queued_group *grp = &feed->groups[g];
        rc = km_index_apply(feed->index, feed->scratch + grp->first, grp->count, &st);
        grp->refused = rc;
        grp->cleared_after = false;
        if (rc == KM_OK) {
            tell_stored(feed, feed->scratch + grp->first, grp->count);
            stats->updates += grp->count;
            stats->groups++;
            accumulate(&stats->index, &st);
            count_applied(feed, grp, 1);
        } else {
            n_failed++;
            apply_refused_removals(feed, grp, stats);
        }
    }
    stats->groups_failed = n_failed;
    settle_refused_groups(feed, n_failed);
    for (size_t g = 0, k = 0; g < feed->group_count; g++)
        if (feed->groups[g].refused != KM_OK)
            feed->groups[k++] = feed->groups[g]; /* compact the failures in place (k <= g) */
    /* Mark the failures after the queue is reset: a DROP-policy clear queues into it. */
    queued_group failed_small[16];
    queued_group *failed = n_failed <= 16 ? failed_small : malloc(n_failed * sizeof *failed);
    if (failed)
        memcpy(failed, feed->groups, n_failed * sizeof *failed);
    queue_reset(feed);
    for (size_t i = 0; failed && i < n_failed; i++) {
        worker *w = km_feed_find_worker(feed, failed[i].worker);
        if (!w || w->generation != failed[i].generation)
            continue;
        w->c.dropped_messages++;
        w->c.refused_messages++;
        w->c.refused_events += failed[i].events;
        if (failed[i].refused == KM_ERR_MEMORY_CAP)
            w->c.memory_cap_refusals++;
        /* What the message stored is missing from the index until the engine clears the worker:
         * a later message the index took may have done so already. */
        if (!failed[i].cleared_after)
            km_feed_enter_degraded(feed, w, now_ns, "the index refused a message's updates");
    }
    if (failed != failed_small)
        free(failed);
    if (feed->queue_count) {
        /* Only clears (DROP policy): they never allocate, so apply them now. */
        for (size_t i = 0; i < feed->queue_count; i++) {
            const queued_update *q = &feed->queue[i];
            km_update u = {q->kind, q->worker, q->parent, NULL, 0, KM_TIER_DEVICE};
            if (km_index_apply(feed->index, &u, 1, &st) == KM_OK)
                accumulate(&stats->index, &st);
        }
        queue_reset(feed);
    }
    publish_positions(feed);
    return km_feed_fail(feed, first_error, "%zu message(s) dropped: %s", n_failed, detail);
}
